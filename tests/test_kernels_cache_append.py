"""Rotary and the KV-cache append in one kernel (kernels/cache_append.py) against PyTorch's form, over cache layouts,
lengths, heads, head_dims and rotary layouts: every cache entry checked, written or not."""

import pytest
import torch

from flashformer.kernels import flash_attn_with_kvcache
from flashformer.kernels.cache_append import (ROWS, Rotary, rotate_and_append, rotate_and_append_packed,
                                              rotate_and_append_packed_reference, rotate_and_append_reference)


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


def _both(q, caches, k, v, lengths, table, batch_idx, rotary):
    """(q, k_cache, v_cache) after the kernel and after PyTorch's form, each on its own copy of the caches."""
    expected = [c.clone() for c in caches]
    q_expected = rotate_and_append_reference(q, *expected, k, v, lengths, table, batch_idx, rotary)
    actual = [c.clone() for c in caches]
    q_actual = rotate_and_append(q, *actual, k, v, lengths, table, batch_idx, rotary, triton_path=True)
    return (q_actual, *actual), (q_expected, *expected)


def _assert_rounding_apart(actual, expected):
    """Equal but for the last bit of a rotated element: the kernel may fuse a product into an add that PyTorch
    rounds on its own."""
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.float(), e.float(), rtol=torch.finfo(a.dtype).eps, atol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "batch_idx", "paged"])
@pytest.mark.parametrize("batch, seqlen_new, heads_kv, head_dim", [
    (1, 1, 8, 128), (3, 1, 2, 64), (2, 5, 3, 80), (4, 17, 1, 256), (2, 40, 2, 16)])
def test_append_writes_what_index_put_writes(device, layout, batch, seqlen_new, heads_kv, head_dim):
    capacity = 48
    k_cache, v_cache, table, batch_idx = _caches(layout, batch, capacity, heads_kv, head_dim, torch.bfloat16, device)
    lengths = torch.randint(0, capacity - seqlen_new + 1, (batch,), dtype=torch.int32, device=device)
    q = torch.randn(batch, 1, heads_kv, head_dim, dtype=torch.bfloat16, device=device)
    k, v = (torch.randn(batch, seqlen_new, heads_kv, head_dim, dtype=torch.bfloat16, device=device) for _ in range(2))
    actual, expected = _both(q, (k_cache, v_cache), k, v, lengths, table, batch_idx, None)
    assert actual[0] is q and all(torch.equal(a, e) for a, e in zip(actual, expected))


@pytest.mark.parametrize("layout, lengths_as", [("contiguous", "tensor"), ("contiguous", "int"), ("paged", "tensor")])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("per_query_token", [True, False])
@pytest.mark.parametrize("head_dim, rotary_dim", [(64, 64), (80, 32)])
def test_rotary_and_append_match_pytorch(device, layout, lengths_as, interleaved, per_query_token, head_dim,
                                         rotary_dim):
    """q and the new keys turned at their cache positions (all of head_dim, or its first rotary_dim dims), the keys
    and values appended; an int length addresses a contiguous cache, as flash_attn_with_kvcache takes it."""
    batch, seqlen_q, seqlen_new, heads_q, heads_kv, capacity = 3, 4, 3, 4, 2, 32
    k_cache, v_cache, table, _ = _caches(layout, batch, capacity, heads_kv, head_dim, torch.float16, device)
    lengths = (torch.tensor([0, 11, capacity - seqlen_new], dtype=torch.int32, device=device)
               if lengths_as == "tensor" else 7)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, dtype=torch.float16, device=device)
    k, v = (torch.randn(batch, seqlen_new, heads_kv, head_dim, dtype=torch.float16, device=device) for _ in range(2))
    angles = torch.rand(capacity + seqlen_q, rotary_dim // 2, device=device) * 6.3
    rotary = Rotary(angles.cos(), angles.sin(), interleaved, per_query_token)
    actual, expected = _both(q, (k_cache, v_cache), k, v, lengths, table, None, rotary)
    assert not torch.equal(actual[0], q)  # the queries turned
    _assert_rounding_apart(actual, expected)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_reads_cos_and_sin_through_their_strides(device, interleaved):
    """cos / sin as views into a wider table, from its second row on (unaligned, a row stride of 24): the kernel
    turns by the same angles as PyTorch's form."""
    batch, heads_kv, head_dim, capacity = 2, 2, 64, 32
    k_cache, v_cache, _, _ = _caches("contiguous", batch, capacity, heads_kv, head_dim, torch.float16, device)
    table = torch.rand(capacity + 2, 24, device=device) * 6.3
    rotary = Rotary(table.cos()[1:, 4:20], table.sin()[1:, 4:20], interleaved, True)  # rotary_dim 32 of 64
    q = torch.randn(batch, 3, 4, head_dim, dtype=torch.float16, device=device)
    k, v = (torch.randn(batch, 3, heads_kv, head_dim, dtype=torch.float16, device=device) for _ in range(2))
    lengths = torch.tensor([5, 29], dtype=torch.int32, device=device)
    assert rotary.cos.stride(0) == 24 and not rotary.cos.is_contiguous()
    actual, expected = _both(q, (k_cache, v_cache), k, v, lengths, None, None, rotary)
    assert not torch.equal(actual[0], q)
    _assert_rounding_apart(actual, expected)


def test_append_reads_strided_new_tokens_and_many_programs(device):
    """k and v as views of a packed kv tensor (strided rows), and more rows than one program holds."""
    batch, seqlen_new, heads_kv, head_dim = 2, 3 * ROWS // 4 + 1, 4, 32
    k_cache, v_cache, _, _ = _caches("contiguous", batch, 128, heads_kv, head_dim, torch.float16, device)
    kv = torch.randn(batch, seqlen_new, 2, heads_kv, head_dim, dtype=torch.float16, device=device)
    k, v = kv.unbind(2)
    lengths = torch.tensor([0, 128 - seqlen_new], dtype=torch.int32, device=device)
    q = torch.randn(batch, 1, heads_kv, head_dim, dtype=torch.float16, device=device)
    actual, expected = _both(q, (k_cache, v_cache), k, v, lengths, None, None, None)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))


def test_append_skips_positions_past_the_cache(device):
    """An unchecked length that runs past the cache writes the entries that fit and nothing beyond: the caches'
    neighbouring memory (here the next sequence's row) keeps its values."""
    k_cache, v_cache, _, _ = _caches("contiguous", 2, 16, 2, 64, torch.float32, device)
    k, v = (torch.randn(2, 4, 2, 64, device=device) for _ in range(2))
    lengths = torch.tensor([14, 0], dtype=torch.int32, device=device)
    before = k_cache.clone()
    rotate_and_append(k[:, :1], k_cache, v_cache, k, v, lengths, None, None, None, triton_path=True)
    assert torch.equal(k_cache[0, 14:], k[0, :2]) and torch.equal(k_cache[0, :14], before[0, :14])
    assert torch.equal(k_cache[1, :4], k[1]) and torch.equal(k_cache[1, 4:], before[1, 4:])


@pytest.mark.parametrize("rotary", [None, "interleaved", "halves"])
def test_decoding_appends_as_the_pytorch_path(device, triton_path, monkeypatch, rotary):
    """flash_attn_with_kvcache with k, v and per-sequence lengths: the Triton path's cache after the call equals
    the PyTorch path's (up to a rotated element's last bit), and so do the outputs within the kernels' rounding."""
    batch, heads_q, heads_kv, head_dim, capacity = 3, 4, 2, 64, 40
    k_cache, v_cache, _, _ = _caches("contiguous", batch, capacity, heads_kv, head_dim, torch.float16, device)
    q = torch.randn(batch, 2, heads_q, head_dim, dtype=torch.float16, device=device)
    k, v = (torch.randn(batch, 2, heads_kv, head_dim, dtype=torch.float16, device=device) for _ in range(2))
    lengths = torch.tensor([0, 17, 38], dtype=torch.int32, device=device)
    rotary_args = {}
    if rotary is not None:
        angles = torch.rand(capacity, head_dim // 2, device=device) * 6.3
        rotary_args = dict(rotary_cos=angles.cos(), rotary_sin=angles.sin(), rotary_interleaved=rotary == "interleaved")
    caches = [c.clone() for c in (k_cache, v_cache)]
    out = flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lengths, causal=True, **rotary_args)
    monkeypatch.setenv("FLASHFORMER_KERNEL", "torch")
    torch_caches = [c.clone() for c in (k_cache, v_cache)]
    torch_out = flash_attn_with_kvcache(q, *torch_caches, k, v, cache_seqlens=lengths, causal=True, **rotary_args)
    _assert_rounding_apart(caches, torch_caches)
    torch.testing.assert_close(out, torch_out, atol=2e-3, rtol=0)


@pytest.mark.parametrize("new_tokens", [[3], [2, 0, 5], [0, 1, 0, 4, 2], [ROWS // 2 + 3, 1]],
                         ids=["one", "three", "five-empty", "many-rows"])
@pytest.mark.parametrize("layout", ["rows", "paged"])
@pytest.mark.parametrize("rotary", [None, "interleaved", "halves", "halves-first"])
@pytest.mark.parametrize("lengths_as", ["tensor", "int"])
def test_packed_append_matches_pytorch(device, new_tokens, layout, rotary, lengths_as):
    """flash-attn 3's packed tokens (cu_seqlens_k_new, cu_seqlens_q): each row finds its sequence in the kernel,
    empty sequences own no row; the caches, written or not, and the rotated queries equal PyTorch's form."""
    batch, heads_q, heads_kv, head_dim, capacity = len(new_tokens), 4, 2, 48, 64
    if layout == "paged":
        k_cache, v_cache, table, _ = _caches("paged", batch, capacity, heads_kv, head_dim, torch.float16, device)
    else:  # a contiguous cache, one page per sequence, as kvcache_packed reads it
        k_cache, v_cache, _, _ = _caches("contiguous", batch, capacity, heads_kv, head_dim, torch.float16, device)
        table = torch.arange(batch, dtype=torch.int32, device=device)[:, None]
    lengths = (torch.randint(0, capacity - max(new_tokens) + 1, (batch,), dtype=torch.int32, device=device)
               if lengths_as == "tensor" else capacity - max(new_tokens))
    queries = [n + 1 for n in new_tokens]
    cu_k, cu_q = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device)
                  for n in (new_tokens, queries))
    q = torch.randn(sum(queries), heads_q, head_dim, dtype=torch.float16, device=device)
    k, v = (torch.randn(sum(new_tokens), heads_kv, head_dim, dtype=torch.float16, device=device) for _ in range(2))
    turn = None
    if rotary is not None:
        angles = torch.rand(capacity + max(queries), 16, device=device) * 6.3
        turn = Rotary(angles.cos(), angles.sin(), rotary == "interleaved", rotary != "halves-first")
    expected = [c.clone() for c in (k_cache, v_cache)]
    q_expected, seqlens_expected = rotate_and_append_packed_reference(q, *expected, k, v, lengths, table, cu_q, cu_k,
                                                                      turn)
    actual = [c.clone() for c in (k_cache, v_cache)]
    q_actual, seqlens = rotate_and_append_packed(q, *actual, k, v, lengths, table, cu_q, cu_k, turn, triton_path=True)
    assert (q_actual is q) == (rotary is None)
    assert seqlens.dtype == torch.int32 and torch.equal(seqlens, seqlens_expected)
    assert torch.equal(seqlens_expected.cpu(), torch.tensor(new_tokens) + (lengths.cpu() if lengths_as == "tensor"
                                                                           else lengths)), "lengths after the append"
    _assert_rounding_apart((q_actual, *actual), (q_expected, *expected))
    assert not any(torch.equal(a, c) for a, c in zip(actual, (k_cache, v_cache))), "the append wrote nothing"
