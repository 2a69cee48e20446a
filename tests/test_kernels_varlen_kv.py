"""flash_attn_varlen_func with paged keys (block_table) and seqused_k, against dense fp64 math per sequence.

Keys a call must not read are NaN: a pool's pages past each sequence's keys and its spare pages, and the
packed keys past seqused_k; block_table entries past a sequence's pages are out of range.
"""

import pytest
import torch
from attention_checks import assert_within_2x

from flashformer.kernels import (attention_materialized, cu_seqlens_from_lengths, decode, flash_attn_varlen_func,
                                 flash_attn_with_kvcache, launch)

UNUSED_PAGE = 1 << 20  # block_table entries past a sequence's pages: must never be read


class Batch:
    """Packed queries over per-sequence keys ``lengths_k`` (of which ``used`` are used, None = all), laid
    out packed (page_size None) or in a shuffled paged pool."""

    def __init__(self, lengths_q, lengths_k, heads, head_dim, dtype, page_size, used, device, head_dim_v=None):
        (heads_q, heads_kv), head_dim_v = heads, head_dim_v or head_dim
        self.lengths_q, self.used = lengths_q, used if used is not None else lengths_k
        self.cu_q, self.cu_k = (cu_seqlens_from_lengths(n).to(device) for n in (lengths_q, lengths_k))
        self.q = torch.randn(sum(lengths_q), heads_q, head_dim, device=device, dtype=dtype)
        self.keys = [torch.randn(n, heads_kv, head_dim, device=device, dtype=dtype) for n in lengths_k]
        self.values = [torch.randn(n, heads_kv, head_dim_v, device=device, dtype=dtype) for n in lengths_k]
        self.seqused_k = None if used is None else torch.tensor(used, dtype=torch.int32, device=device)
        self.block_table = None
        if page_size is None:
            self.k, self.v = torch.cat(self.keys), torch.cat(self.values)
            for b, (first, n) in enumerate(zip(self.cu_k.tolist(), self.used)):  # unused keys: NaN
                self.k[first + n:first + lengths_k[b]] = float("nan")
                self.v[first + n:first + lengths_k[b]] = float("nan")
            return
        pages = [-(-n // page_size) for n in lengths_k]
        num_blocks = sum(pages) + 3  # spare pages, never referenced
        order = torch.randperm(num_blocks).tolist()
        self.block_table = torch.full((len(lengths_k), max(pages) + 1), UNUSED_PAGE, dtype=torch.int32)
        self.k = torch.full((num_blocks, page_size, heads_kv, head_dim), float("nan"), device=device, dtype=dtype)
        self.v = torch.full((num_blocks, page_size, heads_kv, head_dim_v), float("nan"), device=device, dtype=dtype)
        for b, n in enumerate(self.used):  # the pages' entries past the used keys stay NaN
            for j in range(pages[b]):
                page = self.block_table[b, j] = order.pop()
                rows = range(j * page_size, max(j * page_size, min(n, (j + 1) * page_size)))
                self.k[page, :len(rows)] = self.keys[b][rows.start:rows.stop]
                self.v[page, :len(rows)] = self.values[b][rows.start:rows.stop]
        self.block_table = self.block_table.to(device)

    def run(self, **opts):
        return flash_attn_varlen_func(self.q, self.k, self.v, self.cu_q, self.cu_k, max(self.lengths_q),
                                      max(len(t) for t in self.keys), block_table=self.block_table,
                                      seqused_k=self.seqused_k, return_lse=True, **opts)

    def reference(self, upcast, alibi_slopes=None, **opts):
        """(out, lse (heads_q, total_q)) of dense attention per sequence over its first used keys; alibi_slopes
        (heads_q,) or (batch, heads_q)."""
        outs, lses = [], []
        for b, n in enumerate(self.used):
            q0, q1 = self.cu_q[b].item(), self.cu_q[b + 1].item()
            tensors = [self.q[None, q0:q1], self.keys[b][None, :n], self.values[b][None, :n]]
            slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
            out, lse = attention_materialized(*[t.double() if upcast else t for t in tensors], upcast=upcast,
                                              alibi_slopes=slopes, **opts)
            outs.append(out[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1)


def assert_matches_reference(batch, **opts):
    out, lse = batch.run(**opts)
    ref_out, ref_lse = batch.reference(True, **opts)
    assert_within_2x("out", out, ref_out, batch.reference(False, **opts)[0])
    seen = torch.isfinite(ref_lse)
    assert lse.shape == ref_lse.shape
    assert torch.equal(torch.isneginf(lse), ~seen), "lse must be -inf exactly for rows that see no key"
    torch.testing.assert_close(lse[seen], ref_lse[seen].float(), atol=2e-3, rtol=0)
    assert (out.transpose(0, 1)[~seen] == 0).all(), "rows that see no key must output 0"


CASES = [  # lengths_q, lengths_k, used (None: seqused_k not given), heads, head_dim, page_size, mask, dtype
    ([3, 0, 5, 1], [20, 7, 33, 0], None, (4, 2), 32, 16, (True, (-1, -1), 0.0), torch.float16),
    ([9, 2], [70, 2], None, (6, 2), 64, 48, (False, (-1, -1), 0.0), torch.bfloat16),
    ([4, 17, 1], [40, 10, 96], [40, 3, 50], (4, 1), 64, 32, (True, (9, -1), 0.0), torch.float16),
    ([6, 6], [37, 5], [30, 0], (2, 2), 40, None, (True, (-1, -1), 8.0), torch.bfloat16),
    ([1, 12, 3], [64, 19, 20], [64, 19, 11], (6, 3), 64, None, (False, (5, 3), 0.0), torch.float16),
]


def _case_id(lengths_q, lengths_k, used, heads, head_dim, page_size, mask, dtype):
    causal, window, softcap = mask
    return (f"q{'-'.join(map(str, lengths_q))}-k{'-'.join(map(str, lengths_k))}-used{used is not None}-"
            f"h{heads[0]}:{heads[1]}-d{head_dim}-{f'page{page_size}' if page_size else 'packed'}-"
            f"{'causal' if causal else 'full'}-w{window[0]},{window[1]}-cap{softcap:g}-{str(dtype)[6:]}")


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("lengths_q,lengths_k,used,heads,head_dim,page_size,mask,dtype",
                         [pytest.param(*c, id=_case_id(*c)) for c in CASES])
def test_varlen_kv_matches_reference(lengths_q, lengths_k, used, heads, head_dim, page_size, mask, dtype, impl,
                                     device, monkeypatch):
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    causal, window_size, softcap = mask
    batch = Batch(lengths_q, lengths_k, heads, head_dim, dtype, page_size, used, device)
    assert_matches_reference(batch, causal=causal, window_size=window_size, softcap=softcap)


def test_paged_with_seqused_k_and_head_dim_v(device, triton_path):
    """seqused_k below the pages' keys (the pages past it hold NaN), and a narrower head_dim_v."""
    batch = Batch([5, 2], [50, 30], (4, 2), 48, torch.float16, 16, [41, 30], device, head_dim_v=24)
    out, _ = batch.run(causal=True)
    assert out.shape == (7, 4, 24)
    assert_matches_reference(batch, causal=True)


@pytest.mark.parametrize("queries", ["decode", "prompt"])
def test_paged_calls_compile_full_graph(queries, device, triton_path, monkeypatch):
    """Paged keys trace with no graph break (the kernels behind one torch.library op), on the decode kernel (a
    few queries) and on the dense forward (prompts filling a GPU of 4 SMs), and compute the eager result."""
    monkeypatch.setattr(decode, "device_sms", lambda device: 4)  # on a GPU too: its SMs would need long prompts
    lengths_q = [3, 2] if queries == "decode" else [130, 140]
    batch = Batch(lengths_q, [150, 90], (2, 1), 32, torch.float16, 16, None, device)

    def step(q, k, v):
        return flash_attn_varlen_func(q, k, v, batch.cu_q, batch.cu_k, max(lengths_q), 150,
                                      block_table=batch.block_table, causal=True, return_lse=True)

    eager = step(batch.q, batch.k, batch.v)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(batch.q, batch.k, batch.v)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_split_keys_are_merged(device, triton_path):
    """A sequence long enough for the split-KV heuristic to cut it (the combine kernel over packed rows)."""
    batch = Batch([3, 2], [1100, 40], (2, 1), 16, torch.float16, 64, None, device)
    assert_matches_reference(batch, causal=True)


PROMPTS_OVER_PAGES = [  # lengths_q, lengths_k, used, heads, head_dim, page_size, mask, dtype
    ([130, 150], [160, 200], None, (2, 1), 64, 16, (True, (-1, -1), 0.0), torch.float16),
    ([140, 129, 131], [140, 300, 35], [140, 250, 35], (4, 2), 40, 48, (True, (70, -1), 0.0), torch.bfloat16),
    ([200, 90], [260, 90], None, (2, 2), 128, 32, (False, (-1, -1), 10.0), torch.bfloat16),
]


@pytest.mark.parametrize("lengths_q,lengths_k,used,heads,head_dim,page_size,mask,dtype",
                         [pytest.param(*c, id=_case_id(*c)) for c in PROMPTS_OVER_PAGES])
def test_prompts_over_pages_take_the_dense_forward(lengths_q, lengths_k, used, heads, head_dim, page_size, mask,
                                                   dtype, device, monkeypatch):
    """Where decode.dense_forward_pays (here a GPU of 4 SMs), packed queries over pages run the tl forward, each
    key row read through the block table: bit for bit that kernel over the same keys packed, within the 2x rule
    of the reference, with tiles that span pages (16 keys a page) and pages that end inside a tile (48)."""
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    monkeypatch.setattr(decode, "device_sms", lambda device: 4)  # on a GPU too: its SMs would need long prompts
    monkeypatch.setenv("FLASHFORMER_KERNEL", "triton")
    causal, window_size, softcap = mask
    opts = dict(causal=causal, window_size=window_size, softcap=softcap)
    paged = Batch(lengths_q, lengths_k, heads, head_dim, dtype, page_size, used, device)
    assert decode.dense_forward_pays(len(lengths_q), heads[0], sum(lengths_q) // len(lengths_q), torch.device(device))
    out, lse = paged.run(**opts)
    packed = dict(k=torch.cat(paged.keys), v=torch.cat(paged.values), block_table=None)
    dense, dense_lse = flash_attn_varlen_func(paged.q, packed["k"], packed["v"], paged.cu_q, paged.cu_k,
                                              max(lengths_q), max(lengths_k), seqused_k=paged.seqused_k,
                                              return_lse=True, **opts)
    assert torch.equal(out, dense) and torch.equal(lse, dense_lse)
    assert_matches_reference(paged, **opts)


@pytest.mark.parametrize("queries", ["decode", "prompt"])
def test_a_strided_block_table_reads_as_its_contiguous_copy(queries, device, triton_path, monkeypatch):
    """A block table that is a strided view (every other column of a wider tensor, whose other columns point past
    the pool) gives what its contiguous copy gives, on the split decode kernel and on the dense forward, through
    flash_attn_varlen_func and flash_attn_with_kvcache."""
    monkeypatch.setattr(decode, "device_sms", lambda device: 4)
    lengths_q = [3, 2] if queries == "decode" else [130, 140]
    batch = Batch(lengths_q, [150, 90], (2, 1), 32, torch.float16, 16, None, device)
    strided = torch.stack([batch.block_table, torch.full_like(batch.block_table, UNUSED_PAGE)], -1).flatten(1)[:, ::2]
    assert torch.equal(strided, batch.block_table) and strided.stride(1) == 2
    expected = batch.run(causal=True)
    batch.block_table = strided
    for got, want in zip(batch.run(causal=True), expected):
        assert torch.equal(got, want)
    rows = len(lengths_q) * [max(lengths_q)]  # the same queries, padded to one length, over the caches as pages
    q = torch.randn(len(rows), rows[0], 2, 32, device=device, dtype=torch.float16)
    lengths = torch.tensor([150, 90], dtype=torch.int32, device=device)
    with torch.no_grad():
        expected = flash_attn_with_kvcache(q, batch.k, batch.v, cache_seqlens=lengths,
                                           block_table=strided.contiguous(), causal=True)
        assert torch.equal(flash_attn_with_kvcache(q, batch.k, batch.v, cache_seqlens=lengths, block_table=strided,
                                                   causal=True), expected)


@pytest.mark.parametrize("queries", ["decode", "prompt"])
@pytest.mark.parametrize("slopes", ["per-head", "per-sequence"])
def test_paged_alibi_matches_reference(queries, slopes, device, triton_path, monkeypatch):
    """ALiBi over paged keys, flash-attn's bias bottom-right aligned in each sequence: on the split decode kernel (a
    few queries a sequence) and on the tl forward (prompts, where the route's rule sees a GPU of 4 SMs)."""
    monkeypatch.setattr(decode, "device_sms", lambda device: 4)
    lengths_q, lengths_k = ([3, 1, 4], [40, 9, 70]) if queries == "decode" else ([130, 140], [160, 140])
    batch = Batch(lengths_q, lengths_k, (4, 2), 32, torch.float16, 16, None, device)
    dense = decode.dense_forward_pays(len(lengths_q), 4, sum(lengths_q) // len(lengths_q), torch.device(device))
    assert dense == (queries == "prompt")
    shape = (len(lengths_q), 4) if slopes == "per-sequence" else (4,)
    assert_matches_reference(batch, causal=True, alibi_slopes=torch.rand(shape, device=device))


def _reference_grads(batch, grad_out, upcast, alibi_slopes=None, **opts):
    """(out, dq, dk, dv) of dense attention per sequence over its first used packed keys; alibi_slopes
    (batch, heads_q) or None."""
    leaves = [(t.double() if upcast else t).detach().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    outs = []
    for b, n in enumerate(batch.used):
        q0, q1, k0 = batch.cu_q[b].item(), batch.cu_q[b + 1].item(), batch.cu_k[b].item()
        out, _ = attention_materialized(leaves[0][None, q0:q1], leaves[1][None, k0:k0 + n],
                                        leaves[2][None, k0:k0 + n], upcast=upcast,
                                        alibi_slopes=None if alibi_slopes is None else alibi_slopes[b], **opts)
        outs.append(out[0])
    out = torch.cat(outs)
    return (out, *torch.autograd.grad(out, leaves, grad_out.to(out.dtype)))


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("impl,deterministic", [("triton", True), ("triton", False), ("torch", True)])
def test_seqused_k_backward(impl, deterministic, alibi, device, monkeypatch):
    """Packed keys with seqused_k train: gradients match the per-sequence math (with per-sequence ALiBi
    slopes too), and the unused keys (NaN here) get a gradient of exactly 0."""
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    batch = Batch([5, 0, 9, 3], [30, 4, 21, 40], (4, 2), 32, torch.bfloat16, None, [17, 4, 0, 33], device)
    grad_out = torch.randn_like(batch.q)
    leaves = [t.detach().clone().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    opts = dict(causal=True, window_size=(12, -1), alibi_slopes=torch.rand(4, 4, device=device) if alibi else None)
    out = flash_attn_varlen_func(*leaves, batch.cu_q, batch.cu_k, 9, 40, seqused_k=batch.seqused_k,
                                 deterministic=deterministic, **opts)
    ours = (out, *torch.autograd.grad(out, leaves, grad_out))
    ref, lowp = _reference_grads(batch, grad_out, True, **opts), _reference_grads(batch, grad_out, False, **opts)
    for name, a, r, l in zip(("out", "dq", "dk", "dv"), ours, ref, lowp):
        assert_within_2x(name, a, r, l)
    unused = batch.k.isnan()
    assert (ours[2][unused] == 0).all() and (ours[3][batch.v.isnan()] == 0).all()


def test_pools_of_another_dtype_than_autocast_are_refused(device, triton_path):
    """Under torch.autocast q is cast, the paged pools are not: a cast would copy both whole pools per call. Pools in
    another dtype raise, naming them; in the autocast dtype the call runs in it."""
    batch = Batch([3, 5], [40, 70], (4, 2), 32, torch.float32, 16, None, device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16), pytest.raises(ValueError,
                                                                                      match="paged pools of"):
        batch.run()
    batch.k, batch.v = batch.k.bfloat16(), batch.v.bfloat16()
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        out, _ = batch.run()
    assert out.dtype == torch.bfloat16
    # The reference from the inputs as the kernels read them (bf16-rounded), so that only the output's rounding
    # and the kernels' arithmetic remain.
    batch.q = batch.q.bfloat16()
    batch.keys, batch.values = ([t.bfloat16() for t in ts] for ts in (batch.keys, batch.values))
    ref, _ = batch.reference(True)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)


def test_seqused_k_equals_truncated_offsets(device, triton_path):
    """seqused_k on packed keys gives what the same keys cut to those lengths give through the dense
    varlen kernel (whose offsets then name only the used keys)."""
    batch = Batch([4, 9, 2], [30, 12, 25], (4, 2), 32, torch.float16, None, [17, 12, 0], device)
    out, lse = batch.run(causal=True)
    keys = torch.cat([t[:n] for t, n in zip(batch.keys, batch.used)])
    values = torch.cat([t[:n] for t, n in zip(batch.values, batch.used)])
    cu_used = cu_seqlens_from_lengths(batch.used).to(device)
    dense_out, dense_lse = flash_attn_varlen_func(batch.q, keys, values, batch.cu_q, cu_used, 9, 17, causal=True,
                                                  return_lse=True)
    ref_out, _ = batch.reference(True, causal=True)
    assert_within_2x("out", out, ref_out, dense_out)
    torch.testing.assert_close(lse, dense_lse, atol=2e-3, rtol=0)


def _packed(batch):
    """Packed keys in place of a batch's pages (the pages' order: not the sequences', which these checks
    do not need)."""
    return dict(k=batch.k[:2].flatten(0, 1), v=batch.v[:2].flatten(0, 1), block_table=None)


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _small(device, page_size=16):
    return Batch([3, 2], [20, 9], (2, 1), 16, torch.float16, page_size, None, device)


@pytest.mark.parametrize("change,match", [
    (lambda b: dict(block_table=b.block_table.long()), "block_table must be an int32 tensor \\(batch=2"),
    (lambda b: dict(block_table=b.block_table[:1]), "block_table must be an int32 tensor \\(batch=2"),
    (lambda b: dict(block_table=b.block_table[0]), "block_table must be an int32 tensor"),
    (lambda b: dict(k=b.k.flatten(0, 1), v=b.v.flatten(0, 1)), "k must be a paged pool"),
    (lambda b: dict(k=b.k[:, :8], v=b.v[:, :8]), "page_block_size=8 .* multiple of 16"),
    (lambda b: dict(v=b.v[:-1]), "k and v pools must agree"),
    (lambda b: dict(seqused_k=torch.tensor([3, 2], device=b.q.device)), "seqused_k must be an int32 tensor"),
    (lambda b: dict(seqused_k=torch.tensor([3], dtype=torch.int32, device=b.q.device)),
     "seqused_k must be an int32 tensor of shape \\(batch=2,\\)"),
    (lambda b: dict(seqused_k=_i32([[3, 0], [2, 0]], b.q.device)[:, 0]), "seqused_k must be contiguous"),
    (lambda b: dict(dropout_p=0.1), "no dropout_p"),
    (lambda b: dict(alibi_slopes=torch.ones(3, device=b.q.device)), "alibi_slopes must have shape"),
    (lambda b: dict(q=b.q.clone().requires_grad_()), "forward-only"),
    (lambda b: dict(cu_seqlens_q=b.cu_q.long()), "cu_seqlens_q must be a 1-d int32"),
    (lambda b: dict(check_lengths=1), "check_lengths must be a bool"),
    (lambda b: dict(_packed(b), seqused_k=torch.tensor([3, 2], device=b.q.device)), "seqused_k must be an int32"),
    (lambda b: dict(_packed(b), return_attn_probs=True, seqused_k=_i32([3, 2], b.q.device)), "return_attn_probs"),
])
def test_bad_arguments_name_themselves(change, match, device, triton_path):
    batch = _small(device)
    args = dict(q=batch.q, k=batch.k, v=batch.v, cu_seqlens_q=batch.cu_q, cu_seqlens_k=batch.cu_k, max_seqlen_q=3,
                max_seqlen_k=20, block_table=batch.block_table)
    args.update(change(batch))
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(**args)


BAD_VALUES = [  # (paged, changes, what check_lengths=True says)
    (True, lambda b, d: dict(seqused_k=_i32([21, 9], d)), "seqused_k has 1 entries outside"),
    (False, lambda b, d: dict(seqused_k=_i32([3, -1], d)), "seqused_k has 1 entries outside"),
    (True, lambda b, d: dict(cu_seqlens_k=_i32([0, 20, 80], d), seqused_k=None), "1 sequences hold more keys"),
    (True, lambda b, d: dict(block_table=torch.where(b.block_table == UNUSED_PAGE, b.block_table,
                                                     b.k.shape[0])), "block_table has 3 entries outside"),
]


@pytest.mark.parametrize("paged,change,match", BAD_VALUES)
def test_bad_values_are_caught_when_checked(paged, change, match, device, monkeypatch):
    """check_lengths=True checks them on the Triton path; the PyTorch path, which reads them anyway, always."""
    batch = _small(device, 16 if paged else None)
    args = dict(q=batch.q, k=batch.k, v=batch.v, cu_seqlens_q=batch.cu_q, cu_seqlens_k=batch.cu_k, max_seqlen_q=3,
                block_table=batch.block_table, seqused_k=_i32([20, 9], device))
    args.update(change(batch, device))
    for impl, check in (("triton", True), ("torch", None)):
        monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
        with pytest.raises(ValueError, match=match):
            flash_attn_varlen_func(**args, check_lengths=check)


def test_device_values_are_unread_by_default(device, triton_path):
    """The Triton path's default reads no device value (no host sync, as CUDA-graph capture needs), with
    max_seqlen_k left None too (the block_table's shape bounds it): a seqused_k beyond a sequence's
    length (offsets claiming 9 keys where the pages hold 12), which check_lengths=True rejects, passes
    unseen and uses the keys the pages hold."""
    batch = Batch([3, 2], [20, 12], (2, 1), 16, torch.float16, 16, None, device)
    batch.cu_k, batch.seqused_k = _i32([0, 20, 29], device), _i32([20, 12], device)
    args = dict(q=batch.q, k=batch.k, v=batch.v, cu_seqlens_q=batch.cu_q, cu_seqlens_k=batch.cu_k,
                max_seqlen_q=3, block_table=batch.block_table, seqused_k=batch.seqused_k)
    with pytest.raises(ValueError, match="seqused_k has 1 entries outside"):
        flash_attn_varlen_func(**args, check_lengths=True)
    ref_out, _ = batch.reference(True, causal=True)
    for check in (None, False):
        out = flash_attn_varlen_func(**args, causal=True, check_lengths=check)
        assert_within_2x("out", out, ref_out, batch.reference(False, causal=True)[0])


def _as_cache(batch, max_cache):
    """Batch's per-sequence keys as contiguous caches (batch, max_cache, heads_kv, head_dim), NaN past them."""
    k_cache, v_cache = (torch.full((len(rows), max_cache, *rows[0].shape[1:]), float("nan"), dtype=rows[0].dtype,
                                   device=rows[0].device) for rows in (batch.keys, batch.values))
    for b, (keys, values) in enumerate(zip(batch.keys, batch.values)):
        k_cache[b, :len(keys)], v_cache[b, :len(values)] = keys, values
    return k_cache, v_cache


@pytest.mark.parametrize("layout", ["contiguous", "sliced", "paged"])
@pytest.mark.parametrize("lengths", ["tensor", "int"])
@pytest.mark.parametrize("torch_path", [False, True], ids=["kernels", "torch"])
def test_kvcache_with_packed_queries(layout, lengths, torch_path, device, triton_path, monkeypatch):
    """flash_attn_with_kvcache(cu_seqlens_q=...), flash-attn 3's continuous batching: each sequence's packed
    queries over its own cache (causal, bottom-right), every entry past its length NaN; "sliced": the first
    32 entries of longer caches, read through their strides."""
    if torch_path:
        monkeypatch.setenv("FLASHFORMER_KERNEL", "torch")
    lengths_k = [20, 32, 9] if lengths == "tensor" else [17, 17, 17]
    batch = Batch([3, 1, 5], lengths_k, (4, 2), 32, torch.float16, 16 if layout == "paged" else None, None, device)
    if layout == "paged":
        k_cache, v_cache = batch.k, batch.v
    else:
        k_cache, v_cache = (cache[:, :32] for cache in _as_cache(batch, 32 if layout == "contiguous" else 48))
    cache_seqlens = _i32(lengths_k, device) if lengths == "tensor" else 17
    out, lse = flash_attn_with_kvcache(batch.q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                       block_table=batch.block_table, causal=True, return_softmax_lse=True,
                                       cu_seqlens_q=batch.cu_q, max_seqlen_q=5)
    ref_out, ref_lse = batch.reference(True, causal=True)
    assert out.shape == batch.q.shape and lse.shape == ref_lse.shape
    assert_within_2x("out", out, ref_out, batch.reference(False, causal=True)[0])
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=0)


@pytest.mark.parametrize("torch_path", [False, True], ids=["kernels", "torch"])
def test_kvcache_with_packed_queries_and_alibi(torch_path, device, triton_path, monkeypatch):
    """The packed form with ALiBi slopes per sequence: each sequence's bias aligned to its own cache length."""
    if torch_path:
        monkeypatch.setenv("FLASHFORMER_KERNEL", "torch")
    lengths_k = [20, 32, 9]
    batch = Batch([3, 1, 5], lengths_k, (4, 2), 32, torch.float16, None, None, device)
    k_cache, v_cache = _as_cache(batch, 32)
    slopes = torch.rand(3, 4, device=device)
    out = flash_attn_with_kvcache(batch.q, k_cache, v_cache, cache_seqlens=_i32(lengths_k, device), causal=True,
                                  alibi_slopes=slopes, cu_seqlens_q=batch.cu_q, max_seqlen_q=5)
    assert_within_2x("out", out, batch.reference(True, causal=True, alibi_slopes=slopes)[0],
                     batch.reference(False, causal=True, alibi_slopes=slopes)[0])


@pytest.mark.parametrize("change,match", [
    (dict(k="new"), "k, v and cu_seqlens_k_new go together"),
    (dict(k="new 4-d", cu_seqlens_k_new="offsets"), "k must be a 3-D tensor"),
    (dict(k="new", cu_seqlens_k_new="offsets", cache_seqlens=None), "cache_seqlens=None must be an int"),
    (dict(rotary_cos="cos"), "rotary_cos and rotary_sin must be given together"),
    (dict(rotary_cos="cos", rotary_sin="cos"), "rotary_cos / rotary_sin rotate the new keys before the append"),
    (dict(num_splits=4), "num_splits: flash_attn_with_kvcache with cu_seqlens_q"),
    (dict(q="4-d"), "q must be a 3-D tensor"),
    (dict(cu_seqlens_q=None), "cu_seqlens_q must be a 1-d int32"),
    (dict(k_cache="20 entries"), "max_cache=20 must be a multiple of 16"),
    (dict(k_cache="2 rows"), "k_cache holds 2 sequences, cu_seqlens_q describes 3"),
    (dict(cache_seqlens=33), "cache_seqlens=33 must be an int in"),
])
def test_kvcache_packed_queries_bad_arguments_name_themselves(change, match, device, triton_path):
    batch = Batch([3, 1, 5], [20, 32, 9], (4, 2), 32, torch.float16, None, None, device)
    k_cache, v_cache = _as_cache(batch, 32)
    args = dict(q=batch.q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=_i32([20, 32, 9], device),
                cu_seqlens_q=batch.cu_q, max_seqlen_q=5)
    values = {"new": torch.randn_like(k_cache[:, 0]), "new 4-d": torch.randn_like(k_cache[:, :1]),
              "offsets": _i32([0, 1, 2, 3], device), "cos": torch.ones(32, 16, device=device),
              "4-d": batch.q[None], "20 entries": k_cache[:, :20], "2 rows": k_cache[:2]}
    for name, value in change.items():
        args[name] = values.get(value, value) if isinstance(value, str) else value
    if "k" in change:
        args["v"] = args["k"]
    if "k_cache" in change:
        args["v_cache"] = args["k_cache"]
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(**args)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("lengths", ["tensor", "int"])
@pytest.mark.parametrize("check_lengths", [None, True])
def test_kvcache_packed_queries_append_packed_tokens(paged, lengths, check_lengths, device, triton_path):
    """k / v packed by cu_seqlens_k_new (flash-attn 3's continuous batching step): each sequence's new tokens
    land at its cache_seqlens[b] + i, then its queries attend to the cache with them (causal: the last
    query sees every key); entries past the new lengths stay NaN and unread."""
    new = [2, 0, 5] if lengths == "tensor" else [5, 3, 0]
    lengths_k = [20, 32, 9] if lengths == "tensor" else [17, 15, 12]  # an int: one start (12) for all
    batch = Batch([3, 1, 5], lengths_k, (4, 2), 32, torch.float16, 16 if paged else None, None, device)
    old = [n - m for n, m in zip(lengths_k, new)]
    k_new, v_new = (torch.cat([rows[b][old[b]:] for b in range(3)]) for rows in (batch.keys, batch.values))
    if paged:
        k_cache, v_cache = batch.k.clone(), batch.v.clone()
        for b, n in enumerate(old):  # the new tokens' slots start out NaN: the call writes them
            for j in range(n, lengths_k[b]):
                page = batch.block_table[b, j // 16]
                k_cache[page, j % 16] = v_cache[page, j % 16] = float("nan")
    else:
        k_cache, v_cache = _as_cache(batch, 32)
        for b, n in enumerate(old):
            k_cache[b, n:] = v_cache[b, n:] = float("nan")
    cache_seqlens = _i32(old, device) if lengths == "tensor" else old[0]
    cu_new = cu_seqlens_from_lengths(new).to(device)
    out, lse = flash_attn_with_kvcache(batch.q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                       block_table=batch.block_table, causal=True, return_lse=True,
                                       cu_seqlens_q=batch.cu_q, cu_seqlens_k_new=cu_new, max_seqlen_q=5,
                                       check_lengths=check_lengths)
    ref_out, ref_lse = batch.reference(True, causal=True)
    assert_within_2x("out", out, ref_out, batch.reference(False, causal=True)[0])
    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=0)
    for b in range(3):
        rows = range(lengths_k[b])
        got = (torch.stack([k_cache[batch.block_table[b, j // 16], j % 16] for j in rows]) if paged
               else k_cache[b, :lengths_k[b]])
        assert torch.equal(got, batch.keys[b]), "the cache must hold the old keys and the appended ones"


def test_kvcache_packed_append_past_the_cache_raises_before_writing(device, triton_path):
    batch = Batch([1, 1], [30, 10], (2, 1), 16, torch.float16, None, None, device)
    k_cache, v_cache = _as_cache(batch, 32)
    before = k_cache.clone()
    with pytest.raises(ValueError, match="pass the cache's 32 entries"):
        flash_attn_with_kvcache(batch.q, k_cache, v_cache, torch.randn(4, 1, 16, device=device, dtype=torch.float16),
                                torch.randn(4, 1, 16, device=device, dtype=torch.float16),
                                cache_seqlens=_i32([30, 10], device), cu_seqlens_q=batch.cu_q,
                                cu_seqlens_k_new=_i32([0, 3, 4], device), check_lengths=True)
    assert torch.equal(k_cache.isnan(), before.isnan()) and torch.equal(k_cache.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("interleaved", [True, False])
def test_kvcache_packed_rotary_equals_per_sequence_calls(causal, interleaved, device, triton_path):
    """Rotary with packed tokens rotates each sequence's new keys (and queries) at its own cache positions:
    the packed call equals one dense flash_attn_with_kvcache call per sequence, cache contents included."""
    new, old, head_dim = [2, 3, 1], [7, 0, 20], 32
    q, k, v = (torch.randn(sum(new), h, head_dim, device=device, dtype=torch.float16) for h in (4, 2, 2))
    caches = [torch.randn(3, 32, 2, head_dim, device=device, dtype=torch.float16) for _ in range(2)]
    angles = torch.rand(32, 8, device=device) * 3
    cos, sin, cu = angles.cos(), angles.sin(), cu_seqlens_from_lengths(new).to(device)
    packed_caches = [c.clone() for c in caches]
    out = flash_attn_with_kvcache(q, *packed_caches, k, v, cos, sin, cache_seqlens=_i32(old, device),
                                  causal=causal, rotary_interleaved=interleaved, cu_seqlens_q=cu,
                                  cu_seqlens_k_new=cu, max_seqlen_q=3)
    for b, (first, n) in enumerate(zip(cu.tolist(), new)):
        rows = slice(first, first + n)
        dense_caches = [c[b:b + 1].clone() for c in caches]
        expected = flash_attn_with_kvcache(q[None, rows], *dense_caches, k[None, rows], v[None, rows], cos, sin,
                                           cache_seqlens=old[b], causal=causal, rotary_interleaved=interleaved)
        torch.testing.assert_close(out[rows], expected[0], atol=2e-3, rtol=0)
        for packed_cache, dense_cache in zip(packed_caches, dense_caches):
            torch.testing.assert_close(packed_cache[b], dense_cache[0], atol=0, rtol=0)
