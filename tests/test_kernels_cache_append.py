"""The KV-cache append kernel (kernels/cache_append.py) against PyTorch's index_put_ form, over cache layouts,
lengths, heads and head_dims: every cache entry bit for bit equal, written or not."""

import pytest
import torch

from flashformer.kernels import flash_attn_with_kvcache
from flashformer.kernels.cache_append import APPEND_ROWS, append, append_reference


def _caches(layout, batch, capacity, heads_kv, head_dim, dtype, device, page_size=16):
    """(k_cache, v_cache, block_table, cache_batch_idx) holding random entries (not zeros: an entry the append must
    leave alone keeps its value)."""
    if layout == "paged":
        pages = -(-capacity // page_size)
        shape = (batch * pages + 3, page_size, heads_kv, head_dim)  # spare pages the table never names
        table = torch.randperm(batch * pages + 3, device=device)[:batch * pages].view(batch, pages).int()
        return *(torch.randn(shape, dtype=dtype, device=device) for _ in range(2)), table, None
    rows = batch + 2 if layout == "batch_idx" else batch
    k_cache, v_cache = (torch.randn(rows, capacity, heads_kv, head_dim, dtype=dtype, device=device) for _ in range(2))
    batch_idx = torch.randperm(rows, device=device)[:batch].int() if layout == "batch_idx" else None
    return k_cache, v_cache, None, batch_idx


@pytest.mark.parametrize("layout", ["contiguous", "batch_idx", "paged"])
@pytest.mark.parametrize("batch, seqlen_new, heads_kv, head_dim", [
    (1, 1, 8, 128), (3, 1, 2, 64), (2, 5, 3, 80), (4, 17, 1, 256), (2, 40, 2, 16)])
def test_append_kernel_writes_what_index_put_writes(device, layout, batch, seqlen_new, heads_kv, head_dim):
    capacity = 48
    k_cache, v_cache, table, batch_idx = _caches(layout, batch, capacity, heads_kv, head_dim, torch.bfloat16, device)
    lengths = torch.randint(0, capacity - seqlen_new + 1, (batch,), dtype=torch.int32, device=device)
    k, v = (torch.randn(batch, seqlen_new, heads_kv, head_dim, dtype=torch.bfloat16, device=device) for _ in range(2))
    expected = [c.clone() for c in (k_cache, v_cache)]
    append_reference(*expected, k, v, lengths, table, batch_idx)
    append(k_cache, v_cache, k, v, lengths, table, batch_idx, triton_path=True)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])


def test_append_kernel_reads_strided_new_tokens_and_many_programs(device):
    """k and v as views of a packed qkv tensor (strided rows), and more rows than one program holds."""
    batch, seqlen_new, heads_kv, head_dim = 2, 3 * APPEND_ROWS // 4 + 1, 4, 32
    k_cache, v_cache, _, _ = _caches("contiguous", batch, 128, heads_kv, head_dim, torch.float16, device)
    kv = torch.randn(batch, seqlen_new, 2, heads_kv, head_dim, dtype=torch.float16, device=device)
    k, v = kv.unbind(2)
    lengths = torch.tensor([0, 128 - seqlen_new], dtype=torch.int32, device=device)
    expected = [c.clone() for c in (k_cache, v_cache)]
    append_reference(*expected, k, v, lengths, None, None)
    append(k_cache, v_cache, k, v, lengths, None, None, triton_path=True)
    assert torch.equal(k_cache, expected[0]) and torch.equal(v_cache, expected[1])


def test_append_kernel_skips_positions_past_the_cache(device):
    """An unchecked length that runs past the cache writes the entries that fit and nothing beyond: the caches'
    neighbouring memory (here the next sequence's row) keeps its values."""
    k_cache, v_cache, _, _ = _caches("contiguous", 2, 16, 2, 64, torch.float32, device)
    k, v = (torch.randn(2, 4, 2, 64, device=device) for _ in range(2))
    lengths = torch.tensor([14, 0], dtype=torch.int32, device=device)
    before = k_cache.clone()
    append(k_cache, v_cache, k, v, lengths, None, None, triton_path=True)
    assert torch.equal(k_cache[0, 14:], k[0, :2]) and torch.equal(k_cache[0, :14], before[0, :14])
    assert torch.equal(k_cache[1, :4], k[1]) and torch.equal(k_cache[1, 4:], before[1, 4:])


def test_decoding_with_tensor_lengths_appends_as_the_pytorch_path(device, triton_path, monkeypatch):
    """flash_attn_with_kvcache with k, v and per-sequence lengths: the Triton path's cache after the call equals
    the PyTorch path's, and so do the outputs within the kernels' rounding."""
    batch, heads_q, heads_kv, head_dim, capacity = 3, 4, 2, 64, 40
    k_cache, v_cache, _, _ = _caches("contiguous", batch, capacity, heads_kv, head_dim, torch.float16, device)
    q = torch.randn(batch, 2, heads_q, head_dim, dtype=torch.float16, device=device)
    k, v = (torch.randn(batch, 2, heads_kv, head_dim, dtype=torch.float16, device=device) for _ in range(2))
    lengths = torch.tensor([0, 17, 38], dtype=torch.int32, device=device)
    caches = [c.clone() for c in (k_cache, v_cache)]
    out = flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lengths)
    monkeypatch.setenv("FLASHFORMER_KERNEL", "torch")
    torch_caches = [c.clone() for c in (k_cache, v_cache)]
    torch_out = flash_attn_with_kvcache(q, *torch_caches, k, v, cache_seqlens=lengths)
    assert torch.equal(caches[0], torch_caches[0]) and torch.equal(caches[1], torch_caches[1])
    torch.testing.assert_close(out, torch_out, atol=2e-3, rtol=0)
