"""flash_attn_with_kvcache: the split-KV Triton kernel and the PyTorch path against dense fp64 math.

Each case builds a cache whose entries past each sequence's length are NaN (a stale or fresh cache
holds garbage there) and, for paged caches, a shuffled block_table whose unused entries are out of
range: neither may leak into the result. On CPU the kernels run in Triton's interpreter on a small
selection; ``-m slow`` (run on the GPU) adds the full product.
"""

import itertools

import pytest
import torch
import triton
from attention_checks import assert_within_2x

from flashformer.kernels import attention_materialized, flash_attn_func, flash_attn_varlen_func, launch
from flashformer.kernels import decode, kvcache_checks
from flashformer.kernels.decode import (DEFAULT_SMS, DENSE_QUERY_TILE, RESIDENT_PER_SM, TARGET_KEYS_PER_SPLIT,
                                        choose_num_splits)
from flashformer.kernels.kvcache import flash_attn_with_kvcache

MASKS = [  # (causal, window_size, softcap)
    (True, (-1, -1), 0.0), (False, (-1, -1), 0.0), (True, (17, -1), 0.0), (False, (32, 8), 0.0),
    (True, (-1, -1), 15.0), (True, (40, -1), 5.0),
]
DTYPES = [torch.float16, torch.bfloat16]
UNUSED_PAGE = 1 << 20  # block_table entries past a sequence's pages: must never be read


class Case:
    """A batch of caches holding ``cache_lens[b]`` entries each, plus ``seqlen_new`` tokens to append.

    ``page_size`` None builds a contiguous cache (batch, max_cache, ...), else a paged pool with
    spare pages and a random block_table. ``logical`` holds every sequence's keys/values after the
    append, contiguous, for the reference.
    """

    def __init__(self, cache_lens, seqlen_q, seqlen_new, heads, head_dim, dtype, page_size, device, max_cache=None):
        (heads_q, heads_kv), batch = heads, len(cache_lens)
        self.total = [n + seqlen_new for n in cache_lens]
        max_cache = max_cache or max(self.total) + 5
        if page_size:
            max_cache = -(-max_cache // page_size) * page_size
        kv_shape = (batch, max_cache, heads_kv, head_dim)
        self.q = torch.randn(batch, seqlen_q, heads_q, head_dim, device=device, dtype=dtype)
        self.logical_k = torch.randn(kv_shape, device=device, dtype=dtype)
        self.logical_v = torch.randn(kv_shape, device=device, dtype=dtype)
        self.k = self.logical_k[torch.arange(batch)[:, None], torch.tensor(cache_lens)[:, None] + torch.arange(seqlen_new)]
        self.v = self.logical_v[torch.arange(batch)[:, None], torch.tensor(cache_lens)[:, None] + torch.arange(seqlen_new)]
        for b, n in enumerate(cache_lens):  # what the cache holds before the append
            self.logical_k[b, n:] = float("nan")
            self.logical_v[b, n:] = float("nan")
        self.cache_seqlens = torch.tensor(cache_lens, dtype=torch.int32, device=device)
        self.page_size = page_size
        if page_size is None:
            self.block_table = None
            self.k_cache, self.v_cache = self.logical_k.clone(), self.logical_v.clone()
        else:
            pages_per_seq = max_cache // page_size
            num_blocks = batch * pages_per_seq + 3  # spare pages, never referenced
            perm = torch.randperm(num_blocks, device=device)[:batch * pages_per_seq].view(batch, pages_per_seq)
            self.block_table = perm.int()
            pool = (num_blocks, page_size, heads_kv, head_dim)
            self.k_cache = torch.full(pool, float("nan"), device=device, dtype=dtype)
            self.v_cache = torch.full(pool, float("nan"), device=device, dtype=dtype)
            self.k_cache[perm] = self.logical_k.view(batch, pages_per_seq, page_size, heads_kv, head_dim)
            self.v_cache[perm] = self.logical_v.view(batch, pages_per_seq, page_size, heads_kv, head_dim)
            for b, n in enumerate(self.total):
                self.block_table[b, -(-n // page_size):] = UNUSED_PAGE
        self.k_cache_before, self.v_cache_before = self.k_cache.clone(), self.v_cache.clone()
        for b, n in enumerate(cache_lens):
            self.logical_k[b, n:n + seqlen_new] = self.k[b]
            self.logical_v[b, n:n + seqlen_new] = self.v[b]

    def run(self, causal=True, **opts):
        """(out, lse) of flash_attn_with_kvcache, causal unless asked (as ``reference``); None leaves it to the
        API's default."""
        new = dict(k=self.k, v=self.v) if self.k.shape[1] else {}
        new.update({} if causal is None else dict(causal=causal))
        return flash_attn_with_kvcache(self.q, self.k_cache, self.v_cache, cache_seqlens=self.cache_seqlens,
                                       block_table=self.block_table, return_lse=True, **new, **opts)

    def reference(self, upcast, causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
        """(out, lse) of dense attention per sequence over its valid entries; alibi_slopes (heads_q,) or
        (batch, heads_q)."""
        outs, lses = [], []
        for b, n in enumerate(self.total):
            tensors = [self.q[b:b + 1], self.logical_k[b:b + 1, :n], self.logical_v[b:b + 1, :n]]
            if upcast:
                tensors = [t.double() for t in tensors]
            slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
            out, lse = attention_materialized(*tensors, causal=causal, window_size=window_size, softcap=softcap,
                                              upcast=upcast, alibi_slopes=slopes)
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)

    def assert_cache_appended(self):
        """Entry i of sequence b sits at cache_seqlens[b] + i, and nothing else in the cache changed:
        each sequence's tail (NaN before the call) and the pages no sequence uses."""
        if self.page_size is None:
            k, v = self.k_cache, self.v_cache
            rows = [k.shape[1]] * len(self.total)
        else:
            table = self.block_table.long()
            in_use = table != UNUSED_PAGE
            k, v = (pool[table.masked_fill(~in_use, 0)].flatten(1, 2) for pool in (self.k_cache, self.v_cache))
            rows = (in_use.sum(1) * self.page_size).tolist()
            unused = torch.ones(self.k_cache.shape[0], dtype=torch.bool, device=table.device)
            unused[table[in_use]] = False
            for pool, before in ((self.k_cache, self.k_cache_before), (self.v_cache, self.v_cache_before)):
                torch.testing.assert_close(pool[unused], before[unused], rtol=0, atol=0, equal_nan=True)
        for b, (n, limit) in enumerate(zip(self.total, rows)):
            for cache, logical in ((k, self.logical_k), (v, self.logical_v)):
                torch.testing.assert_close(cache[b, :n], logical[b, :n], rtol=0, atol=0)
                assert cache[b, n:limit].isnan().all(), f"sequence {b}: cache changed past its entries"


def _check_against_reference(case, out, lse, causal, window_size, softcap, alibi_slopes=None):
    opts = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    ref_out, ref_lse = case.reference(True, **opts)
    lowp_out, _ = case.reference(False, **opts)
    assert_within_2x("out", out, ref_out, lowp_out)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~seen), "lse must be -inf exactly for rows that see no entry"
    torch.testing.assert_close(lse[seen], ref_lse[seen].float(), atol=2e-3, rtol=0)
    assert (out.transpose(1, 2)[~seen] == 0).all(), "rows that see no entry must output 0"


# A CPU-sized selection: cache lengths 0 and off every tile / page size, seqlen_q 1..4 with and
# without appended tokens (seqlen_q > seqlen_new too), GQA 8:2, 8:1 and MHA, every mask, both dtypes,
# contiguous and paged (16, 32), forced splits.
QUICK = [
    # cache_lens,    seqlen_q, new, heads, head_dim, mask, dtype, page_size, num_splits
    ((0, 37, 100), 1, 1, (8, 2), 64, 0, 0, None, 0),
    ((5, 64, 129), 4, 4, (8, 1), 128, 0, 1, 16, 0),
    ((50, 0, 77), 2, 0, (4, 4), 64, 1, 0, 32, 3),
    ((90, 33), 3, 3, (8, 2), 128, 2, 1, None, 2),
    ((120, 7), 1, 1, (8, 2), 64, 4, 1, 16, 4),
    ((60, 100, 1), 2, 2, (8, 1), 64, 5, 0, 32, 0),
    ((45, 80), 4, 4, (4, 4), 128, 3, 0, None, 3),
    ((31, 0), 3, 1, (8, 2), 64, 0, 1, None, 5),
]


def _case_id(cache_lens, seqlen_q, new, heads, head_dim, mask, dtype, page_size, num_splits):
    causal, window, softcap = MASKS[mask]
    return (f"lens{'-'.join(map(str, cache_lens))}-q{seqlen_q}-new{new}-h{heads[0]}:{heads[1]}-d{head_dim}-"
            f"{'causal' if causal else 'full'}-w{window[0]},{window[1]}-cap{softcap:g}-{str(DTYPES[dtype])[6:]}-"
            f"{f'page{page_size}' if page_size else 'contig'}-splits{num_splits}")


# The GPU sweep: dtype and forced splits cycle along the product instead of multiplying it.
FULL = [
    (lens, seqlen_q, seqlen_q, heads, head_dim, mask, i % len(DTYPES), page, (0, 1, 7)[i % 3])
    for i, (lens, seqlen_q, heads, head_dim, mask, page) in enumerate(itertools.product(
        [(0, 37, 100), (5, 64, 129), (1000, 4095, 257)], [1, 3], [(8, 8), (8, 2), (8, 1)], [64, 128, 256],
        range(len(MASKS)), [None, 16, 256]))
]
CASES = [pytest.param(*c, id=_case_id(*c)) for c in QUICK] + [
    pytest.param(*c, id=_case_id(*c), marks=pytest.mark.slow) for c in FULL if c not in QUICK]


@pytest.mark.parametrize("cache_lens,seqlen_q,new,heads,head_dim,mask,dtype,page_size,num_splits", CASES)
def test_kvcache_matches_reference(cache_lens, seqlen_q, new, heads, head_dim, mask, dtype, page_size, num_splits,
                                   device, triton_path):
    causal, window_size, softcap = MASKS[mask]
    case = Case(cache_lens, seqlen_q, new, heads, head_dim, DTYPES[dtype], page_size, device)
    out, lse = case.run(causal=causal, window_size=window_size, softcap=softcap, num_splits=num_splits)
    _check_against_reference(case, out, lse, causal, window_size, softcap)
    case.assert_cache_appended()


# Several new query tokens per sequence (speculative decoding, chunked prefill): chunks longer than one
# program's token block (16 rows of a GQA group of 3 padded to 4: 4 tokens), odd cache lengths, fewer
# appended tokens than queries, a page size no power of two (48), every mask.
CHUNKS = [
    # cache_lens,  seqlen_q, new, heads, mask, dtype, page_size, num_splits
    ((0, 13, 45), 7, 7, (6, 2), 0, 0, 48, 0),
    ((29, 3), 19, 19, (6, 2), 2, 1, None, 3),
    ((61, 17, 1), 9, 5, (8, 1), 3, 0, 16, 2),
    ((40, 90), 11, 11, (6, 3), 5, 1, 48, 0),
    ((5, 33), 6, 0, (4, 4), 1, 0, None, 0),
]


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("cache_lens,seqlen_q,new,heads,mask,dtype,page_size,num_splits", CHUNKS,
                         ids=[_case_id(*c[:4], 64, *c[4:]) for c in CHUNKS])
def test_query_chunks_match_reference(cache_lens, seqlen_q, new, heads, mask, dtype, page_size, num_splits, impl,
                                      device, monkeypatch):
    """seqlen_q > 1 with the new keys appended first: causal and windows align bottom-right to each
    sequence's cache length after the append (rows that see no entry output 0)."""
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    causal, window_size, softcap = MASKS[mask]
    case = Case(cache_lens, seqlen_q, new, heads, 64, DTYPES[dtype], page_size, device)
    out, lse = case.run(causal=causal, window_size=window_size, softcap=softcap, num_splits=num_splits)
    _check_against_reference(case, out, lse, causal, window_size, softcap)
    case.assert_cache_appended()


# head_dims 64 and 128: on an H200 the Gluon forward (at 64 from 1k queries, which the GPU's query count reaches),
# reading the cache's rows in use through strided views; a paged cache the tl forward through its block table.
@pytest.mark.parametrize("cached,extra,append,mask,dtype,head_dim,lengths", [
    (0, 0, True, 0, 1, 64, "shared"), (37, 0, True, 2, 0, 128, "shared"), (21, 5, True, 5, 1, 64, "shared"),
    (50, 0, False, 1, 0, 64, "shared"), (37, 3, True, 0, 0, 64, "per-sequence"),
    (50, 0, False, 2, 1, 128, "per-sequence"), (21, 0, True, 5, 1, 128, "per-sequence"),
    (37, 3, True, 0, 0, 64, "paged"), (50, 0, False, 5, 1, 128, "paged")])
def test_prompts_take_the_dense_forward(cached, extra, append, mask, dtype, head_dim, lengths, device, triton_path,
                                        monkeypatch):
    """Where dense_forward_pays (a prompt, a long chunk), queries over a contiguous cache run the dense forward
    over the cache's rows in use: with one shared (int) length bit for bit flash_attn_func on them, with
    per-sequence (tensor) lengths flash_attn_varlen_func over the flattened rows with seqused_k, after the same
    append; over a paged cache (pages of 16 entries, shuffled) bit for bit the tl kernel of that varlen call;
    within the 2x rule of the reference, the entries past each length NaN. The interpreter takes a GPU of 4 SMs,
    which one query tile fills."""
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    monkeypatch.setattr(decode, "DEFAULT_SMS", 4)
    heads, batch = (6, 2), 2
    tiles = triton.cdiv(decode.device_sms(torch.device(device)), batch * heads[0])  # enough to fill the SMs
    seqlen_q = tiles * DENSE_QUERY_TILE + extra
    assert decode.dense_forward_pays(batch, heads[0], seqlen_q, torch.device(device))
    causal, window_size, softcap = MASKS[mask]
    new = seqlen_q if append else 0
    shared = lengths == "shared"
    case = Case((cached, cached if shared else cached // 3), seqlen_q, new, heads, head_dim, DTYPES[dtype],
                16 if lengths == "paged" else None, device)
    new_kv = dict(k=case.k, v=case.v) if new else {}
    opts = dict(causal=causal, window_size=window_size, softcap=softcap)
    out, lse = flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, return_lse=True, **new_kv, **opts,
                                       cache_seqlens=cached if shared else case.cache_seqlens,
                                       block_table=case.block_table)
    case.assert_cache_appended()
    if shared:
        end = cached + new
        dense, dense_lse = flash_attn_func(case.q, case.k_cache[:, :end], case.v_cache[:, :end], return_lse=True,
                                           **opts)
    else:
        if lengths == "paged":
            monkeypatch.setenv("FLASHFORMER_KERNEL", "triton")
        rows = torch.arange(batch + 1, dtype=torch.int32, device=device)
        max_cache = case.logical_k.shape[1]
        dense, dense_lse = flash_attn_varlen_func(
            case.q.flatten(0, 1), case.logical_k.flatten(0, 1), case.logical_v.flatten(0, 1), rows * seqlen_q,
            rows * max_cache, seqlen_q, max_cache, seqused_k=case.cache_seqlens + new, return_lse=True, **opts)
        dense, dense_lse = dense.view(out.shape), dense_lse.view(heads[0], batch, seqlen_q).transpose(0, 1)
    assert torch.equal(out, dense) and torch.equal(lse, dense_lse)
    _check_against_reference(case, out, lse, causal, window_size, softcap)


def test_a_paged_prompt_compiles_full_graph(device, triton_path, monkeypatch):
    """A prompt over a paged cache on the dense forward traces with no graph break (the forward as a
    torch.library op) and computes the eager result. The route's rule sees a GPU of 4 SMs (a real one too)."""
    monkeypatch.setattr(decode, "device_sms", lambda device: 4)
    case = Case((9, 30), DENSE_QUERY_TILE, DENSE_QUERY_TILE, (4, 2), 32, torch.float16, 16, device)
    assert decode.dense_forward_pays(2, 4, DENSE_QUERY_TILE, torch.device(device))

    def step(k_cache, v_cache):
        return flash_attn_with_kvcache(case.q, k_cache, v_cache, case.k, case.v, cache_seqlens=case.cache_seqlens,
                                       block_table=case.block_table, causal=True, return_lse=True)

    eager = step(case.k_cache.clone(), case.v_cache.clone())
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(case.k_cache.clone(), case.v_cache.clone())
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_packed_queries_compile_full_graph(device, triton_path):
    """flash-attn 3's packed form (cu_seqlens_q, cu_seqlens_k_new) traces with no graph break, append included,
    and computes the eager result."""
    caches = [torch.randn(2, 32, 1, 16, device=device, dtype=torch.float16) for _ in range(2)]
    q = torch.randn(5, 2, 16, device=device, dtype=torch.float16)
    k, v = (torch.randn(5, 1, 16, device=device, dtype=torch.float16) for _ in range(2))
    cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    cache_seqlens = torch.tensor([4, 7], dtype=torch.int32, device=device)

    def step(k_cache, v_cache):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cu_seqlens_q=cu_seqlens,
                                      cu_seqlens_k_new=cu_seqlens, max_seqlen_q=3, causal=True)
        return out, k_cache, v_cache

    eager = step(*(c.clone() for c in caches))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*(c.clone() for c in caches))
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_prompts_over_tensor_lengths_leave_the_kept_index_tensors_as_built(device, triton_path, monkeypatch):
    """The per-sequence and paged prompt routes keep their size-only offsets and positions between calls
    (cache_pages.size_index); calls at other lengths write none of them, and each call's output and append
    are its own."""
    from flashformer.kernels import cache_pages

    monkeypatch.setattr(decode, "device_sms", lambda device: 4)  # on a GPU too: its SMs would need long prompts
    monkeypatch.setattr(cache_pages, "_SIZE_INDICES", {})
    seqlen_q = DENSE_QUERY_TILE
    for cached, page_size in ((9, None), (30, None), (9, 16), (30, 16)):
        case = Case((cached, cached // 3), seqlen_q, seqlen_q, (4, 2), 64, torch.float16, page_size, device)
        out, lse = case.run(causal=True)
        case.assert_cache_appended()
        _check_against_reference(case, out, lse, True, (-1, -1), 0.0)
    assert cache_pages._SIZE_INDICES
    for (build, index_device, _stream, *sizes), kept in cache_pages._SIZE_INDICES.items():
        assert torch.equal(kept, build(*sizes, index_device)), build.__name__


def test_traced_calls_make_their_own_index_tensors(monkeypatch):
    """Under torch.compile the size-only index tensors are the graph's own, never kept (a kept one could be freed
    while a CUDA graph reads it)."""
    from flashformer.kernels import cache_pages

    monkeypatch.setattr(cache_pages, "_SIZE_INDICES", {})
    cpu = torch.device("cpu")
    traced = torch.compile(lambda: cache_pages.size_index(cache_pages.arange, 5, device=cpu) * 2,
                           fullgraph=True, backend="aot_eager")
    assert torch.equal(traced(), torch.arange(5) * 2) and not cache_pages._SIZE_INDICES
    assert torch.equal(cache_pages.size_index(cache_pages.arange, 5, device=cpu), torch.arange(5))
    assert len(cache_pages._SIZE_INDICES) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")
def test_each_stream_keeps_its_own_index_tensors(monkeypatch):
    """A kept index tensor is read only on the stream it was built on: built there, its values are written
    before any kernel of that stream reads them."""
    from flashformer.kernels import cache_pages

    monkeypatch.setattr(cache_pages, "_SIZE_INDICES", {})
    cuda = torch.device("cuda")
    first = cache_pages.size_index(cache_pages.arange, 7, device=cuda)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = cache_pages.size_index(cache_pages.arange, 7, device=cuda)
        assert cache_pages.size_index(cache_pages.arange, 7, device=cuda) is on_side
    assert on_side is not first and cache_pages.size_index(cache_pages.arange, 7, device=cuda) is first
    side.synchronize()
    assert torch.equal(on_side, first)


def test_dense_forward_pays_where_its_tiles_fill_the_gpu():
    cpu = torch.device("cpu")  # DEFAULT_SMS: the H200's 132
    assert decode.dense_forward_pays(1, 32, 8192, cpu)  # a long prompt
    assert decode.dense_forward_pays(8, 32, 128, cpu)  # a batch of chunks: 256 query tiles
    assert not decode.dense_forward_pays(1, 32, 128, cpu)  # one chunk: 32 tiles, where splits fill the GPU
    assert not decode.dense_forward_pays(64, 32, 100, cpu)  # less than a query tile per sequence and head
    assert not decode.dense_forward_pays(1, 12, 1024, cpu)  # 96 tiles


@pytest.mark.parametrize("case_index", [0, 1, 3, 5])
def test_torch_path_matches_reference(case_index, device, monkeypatch):
    monkeypatch.setenv("FLASHFORMER_KERNEL", "torch")
    cache_lens, seqlen_q, new, heads, head_dim, mask, dtype, page_size, _ = QUICK[case_index]
    causal, window_size, softcap = MASKS[mask]
    case = Case(cache_lens, seqlen_q, new, heads, head_dim, DTYPES[dtype], page_size, device)
    out, lse = case.run(causal=causal, window_size=window_size, softcap=softcap)
    _check_against_reference(case, out, lse, causal, window_size, softcap)
    case.assert_cache_appended()


@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_equals_contiguous(page_size, device, triton_path):
    """The same sequences, contiguous and through a shuffled block_table (same seed, same draws)."""
    runs = []
    for layout in (None, page_size):
        torch.manual_seed(page_size)
        case = Case((23, 70, 0), 2, 2, (8, 2), 64, torch.bfloat16, layout, device, max_cache=96)
        runs.append(case.run(window_size=(40, -1)))
        case.assert_cache_appended()
    (out_c, lse_c), (out_p, lse_p) = runs
    torch.testing.assert_close(out_p, out_c, atol=1e-2, rtol=0)
    torch.testing.assert_close(lse_p, lse_c, atol=1e-5, rtol=0)


def test_splits_equal_one_split(device, triton_path):
    """Forced splits, including more splits than a sequence has tiles (empty splits), merge exactly."""
    case = Case((150, 3, 64), 3, 0, (8, 2), 64, torch.float16, None, device)
    out_1, lse_1 = case.run(num_splits=1)
    for num_splits in (2, 5, 9):
        out_s, lse_s = case.run(num_splits=num_splits)
        torch.testing.assert_close(out_s, out_1, atol=2e-3, rtol=0)
        torch.testing.assert_close(lse_s, lse_1, atol=1e-5, rtol=0)


def test_split_heuristic():
    cpu = torch.device("cpu")
    slots = RESIDENT_PER_SM * DEFAULT_SMS
    assert choose_num_splits(8, 700, cpu) == 1  # too short to be worth a split
    assert 8 * choose_num_splits(8, 16384, cpu) == DEFAULT_SMS // 8 * 8  # one sequence: a program per SM
    assert choose_num_splits(64 * 8, 65536, cpu) == 65536 // TARGET_KEYS_PER_SPLIT  # long caches: long splits
    for batch, keys in itertools.product((1, 8, 64), (16384, 65536, 163840)):
        programs = batch * 8 * choose_num_splits(batch * 8, keys, cpu)
        # no partly filled wave (batch 1, 40 splits: 320 programs would fill 61% of two waves of two per SM;
        # 17 splits, 136 programs: four SMs would run two)
        for wave in (DEFAULT_SMS, slots):
            assert programs <= DEFAULT_SMS or programs / (-(-programs // wave) * wave) >= 0.95, (batch, keys)


ALIBI_ROUTES = [pytest.param(route, page_size, id=f"{route}-{'paged' if page_size else 'contiguous'}")
                for route in ("decode", "decode-splits", "prompt") for page_size in (None, 16)] + [
    pytest.param("prompt-int-lengths", None, id="prompt-int-lengths-contiguous")]  # int lengths: contiguous only


@pytest.mark.parametrize("route,page_size", ALIBI_ROUTES)
@pytest.mark.parametrize("slopes", ["per-head", "per-sequence"])
def test_alibi_on_every_route(route, page_size, slopes, device, triton_path, monkeypatch):
    """ALiBi (flash-attn's -slope * |i + seqlen_k - seqlen_q - j|, bottom-right) wherever a call runs: the split
    decode kernel (one split and forced splits) and a prompt's dense forward (a contiguous cache on the varlen
    forward or, with int lengths, the dense one; a paged cache on the tl forward through its block table), the
    route's rule seeing a GPU of 4 SMs."""
    monkeypatch.setattr(decode, "device_sms", lambda device: 4)
    prompt = route.startswith("prompt")
    seqlen_q = DENSE_QUERY_TILE if prompt else 3
    case = Case((40, 40) if route == "prompt-int-lengths" else (9, 70), seqlen_q, seqlen_q, (4, 2), 32,
                torch.float16, page_size, device)
    assert decode.dense_forward_pays(2, 4, seqlen_q, torch.device(device)) == prompt
    alibi = torch.rand((2, 4) if slopes == "per-sequence" else (4,), device=device)
    if route == "prompt-int-lengths":
        out, lse = flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, case.k, case.v, cache_seqlens=40,
                                           causal=True, alibi_slopes=alibi, return_lse=True)
    else:
        out, lse = case.run(alibi_slopes=alibi, num_splits=3 if route == "decode-splits" else 0)
    _check_against_reference(case, out, lse, True, (-1, -1), 0.0, alibi)


def test_causal_defaults_to_false_as_in_flash_attn(device, triton_path):
    """A call written for flash-attn that leaves causal out gets flash-attn's default: several query tokens each
    see every entry in use, appended ones included."""
    case = Case((9, 30), 3, 3, (4, 2), 32, torch.float16, None, device)
    out, lse = case.run(causal=None)
    _check_against_reference(case, out, lse, False, (-1, -1), 0.0)
    causal_out, _ = case.reference(True, causal=True)
    assert (out.double() - causal_out).abs().max() > 0.05, "the earlier query tokens must see the later entries"


def test_int_and_default_cache_seqlens(device, triton_path):
    q = torch.randn(2, 1, 4, 32, device=device, dtype=torch.float16)
    k_cache, v_cache = (torch.randn(2, 40, 2, 32, device=device, dtype=torch.float16) for _ in range(2))
    ref, _ = attention_materialized(q.double(), k_cache[:, :25].double(), v_cache[:, :25].double(), causal=True)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=25)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)
    ref, _ = attention_materialized(q.double(), k_cache.double(), v_cache.double(), causal=True)
    out = flash_attn_with_kvcache(q, k_cache, v_cache)  # None: the whole cache is valid
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)


@pytest.mark.parametrize("paged", [False, True])
def test_int_cache_seqlens_equals_tensor(paged, device, triton_path):
    """An int cache_seqlens (validated on the host, appended by slicing) = the same tensor of lengths."""
    args, paged_args = _bad_inputs(device)
    if paged:
        args.update(paged_args)
    runs = []
    for lengths in (7, torch.full((2,), 7, dtype=torch.int32, device=device)):
        caches = {name: args[name].clone() for name in ("k_cache", "v_cache")}
        out = flash_attn_with_kvcache(**{**args, **caches, "cache_seqlens": lengths})
        runs.append((out, caches))
    (out_int, caches_int), (out_tensor, caches_tensor) = runs
    assert torch.equal(out_int, out_tensor)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(caches_int[name], caches_tensor[name])
        assert not torch.equal(caches_int[name], args[name])  # the new entries landed
    with pytest.raises(ValueError, match="too small"):
        flash_attn_with_kvcache(**{**args, "cache_seqlens": 40 if not paged else 32})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CompiledLaunch compiles and caches on CUDA only")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_repeat_launches_reuse_the_compiled_kernel(num_splits, device, triton_path):
    """Calls after the first of one layout reuse its plan, the compiled kernels (launched through
    Triton's C launcher directly) and, with splits, the partial buffers: other lengths, strides and
    buffers must still be read and written where they are. A launch hook (a profiler's) must still
    see every launch."""
    from flashformer.kernels import decode, launch

    decode._decode_launch.compiled.clear()
    hook_calls = []
    enter_hook = triton.knobs.runtime.launch_enter_hook
    for layout, (max_cache, head_step) in enumerate(((128, 1), (320, 2))):
        for call, length in enumerate((100, 77, 101, 90)):
            q = torch.randn(2, 1, 8 * head_step, 64, device=device, dtype=torch.float16)[:, :, ::head_step]
            k_cache, v_cache = (torch.randn(2, max_cache, 2, 64, device=device, dtype=torch.float16)
                                for _ in range(2))
            hooked = layout == 1 and call == 3 and hasattr(enter_hook, "add")
            if hooked:
                enter_hook.add(hook_calls.append)
            try:
                out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=length, num_splits=num_splits)
            finally:
                if hooked:
                    enter_hook.remove(hook_calls.append)
            ref, _ = attention_materialized(q.double(), k_cache[:, :length].double(),
                                            v_cache[:, :length].double(), causal=True)
            torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=0)
    # One compile: each layout's first launch went through Triton and found the same compiled kernel.
    assert len(decode._decode_launch.compiled) == 2
    assert len({id(direct.compiled) for direct in decode._decode_launch.compiled.values()}) == 1
    assert all(direct.c_launch is not None for direct in decode._decode_launch.compiled.values())
    if hasattr(enter_hook, "add"):
        assert len(hook_calls) == (2 if num_splits > 1 else 1)  # decode (+ combine) of the hooked call
    if num_splits > 1:
        assert any(key[-1] == "decode partials" for key in launch._REUSED)


@pytest.mark.parametrize("paged", [False, True])
def test_unchecked_lengths_equal_checked(paged, device, triton_path):
    """Unread lengths (the default and check_lengths=False: no host sync, as CUDA-graph capture needs)
    compute what the checked call does: the same appends, and splits sized for the whole cache (4 for
    2048 entries, against 1 for the 701 in use) that merge to the same result."""
    args, paged_args = _bad_inputs(device)
    if paged:
        args.update(paged_args)
    else:
        args.update(k_cache=torch.randn(2, 2048, 2, 32, device=device, dtype=torch.float16),
                    v_cache=torch.randn(2, 2048, 2, 32, device=device, dtype=torch.float16),
                    cache_seqlens=torch.tensor([3, 700], dtype=torch.int32, device=device))
        assert choose_num_splits(4, 2048, torch.device("cpu")) > choose_num_splits(4, 701, torch.device("cpu"))
    runs = []
    for check in (True, None, False):
        caches = {name: args[name].clone() for name in ("k_cache", "v_cache")}
        runs.append((flash_attn_with_kvcache(**{**args, **caches}, check_lengths=check, return_lse=True), caches))
    ((out_c, lse_c), caches_c), *unchecked = runs
    for (out_u, lse_u), caches_u in unchecked:
        torch.testing.assert_close(out_u, out_c, atol=2e-3, rtol=0)
        torch.testing.assert_close(lse_u, lse_c, atol=1e-5, rtol=0)
        for name in ("k_cache", "v_cache"):
            assert torch.equal(caches_u[name], caches_c[name])


def test_unchecked_lengths_need_the_triton_path(device, monkeypatch):
    monkeypatch.setenv("FLASHFORMER_KERNEL", "torch")
    args, _ = _bad_inputs(device)
    with pytest.raises(ValueError, match="check_lengths=False"):
        flash_attn_with_kvcache(**args, check_lengths=False)
    with pytest.raises(ValueError, match="check_lengths must be a bool or None"):
        flash_attn_with_kvcache(**args, check_lengths="no")
    flash_attn_with_kvcache(**{**args, "cache_seqlens": 3}, check_lengths=False)  # host lengths: nothing to read


def _bad_inputs(device):
    q = torch.randn(2, 1, 4, 32, device=device, dtype=torch.float16)
    k_cache, v_cache = (torch.randn(2, 40, 2, 32, device=device, dtype=torch.float16) for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 32, device=device, dtype=torch.float16) for _ in range(2))
    seqlens = torch.tensor([3, 10], dtype=torch.int32, device=device)
    pool_k, pool_v = (torch.randn(6, 16, 2, 32, device=device, dtype=torch.float16) for _ in range(2))
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=seqlens), dict(
        k_cache=pool_k, v_cache=pool_v, block_table=table)


def _i32(a, *values):
    return torch.tensor(values, dtype=torch.int32, device=a["q"].device)


# Values a tensor cache_seqlens or block_table holds: checked when asked (check_lengths=True), and by the
# PyTorch path, which reads them anyway; the Triton path's default reads none (no host sync).
VALUE_CHECKS = [
    (False, lambda a: dict(cache_seqlens=_i32(a, 3, 40)), "too small: sequence 1 needs 41"),
    (True, lambda a: dict(cache_seqlens=_i32(a, 3, 32)), "too small: sequence 1 needs 33"),
    (True, lambda a: dict(block_table=_i32(a, [0, 1], [6, 3])), "block_table has 1 entries outside"),
    (True, lambda a: dict(block_table=_i32(a, [-1, 1], [2, 3])), "block_table has 1 entries outside"),
    (True, lambda a: dict(cache_seqlens=20, block_table=_i32(a, [0, 6], [2, 3])), "block_table has 1 entries outside"),
    (False, lambda a: dict(cache_seqlens=_i32(a, -1, 3)), "cache_seqlens\\[0\\] = -1 is negative"),
]


@pytest.mark.parametrize("paged,change,match", VALUE_CHECKS)
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_bad_values_are_caught_when_checked(impl, paged, change, match, device, monkeypatch):
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    args, paged_args = _bad_inputs(device)
    if paged:
        args.update(paged_args)
    args.update(change(args))
    caches = [args["k_cache"].clone(), args["v_cache"].clone()]
    for check in (True, None) if impl == "torch" else (True,):
        with pytest.raises(ValueError, match=match):
            flash_attn_with_kvcache(**args, check_lengths=check)
    assert torch.equal(args["k_cache"], caches[0]) and torch.equal(args["v_cache"], caches[1]), "cache modified"


# Bad values that leave the kernels inside the caches when unread (no new tokens to append): a length
# past a contiguous cache's end reads the descriptors' zero fill, as does a page past the pool's end; a
# negative length reads nothing.
UNREAD_VALUES = [
    (False, lambda a: dict(cache_seqlens=_i32(a, 3, 41))),
    (True, lambda a: dict(block_table=_i32(a, [0, 1], [6, 3]))),
    (True, lambda a: dict(cache_seqlens=20, block_table=_i32(a, [0, 6], [2, 3]))),
    (False, lambda a: dict(cache_seqlens=_i32(a, -1, 3))),
]


@pytest.mark.parametrize("paged,change", UNREAD_VALUES)
def test_device_values_are_unread_by_default(paged, change, device, triton_path):
    """The Triton path's default (and check_lengths=False) reads no device value, so no host sync:
    values that check_lengths=True rejects pass unseen."""
    args, paged_args = _bad_inputs(device)
    if paged:
        args.update(paged_args)
    args.update(change(args), k=None, v=None)
    with pytest.raises(ValueError, match="too small|outside|negative"):
        flash_attn_with_kvcache(**args, check_lengths=True)
    for check in (None, False):
        assert flash_attn_with_kvcache(**args, check_lengths=check).shape == args["q"].shape


@pytest.mark.parametrize("paged,change,match", [
    (True, lambda a: dict(block_table=a["block_table"].long()), "block_table must be an int32"),
    (True, lambda a: dict(block_table=a["block_table"][:1]), "block_table must be \\(batch=2"),
    (False, lambda a: dict(cache_seqlens=a["cache_seqlens"][:1]), "cache_seqlens must be"),
    (False, lambda a: dict(cache_seqlens=a["cache_seqlens"].long()), "cache_seqlens must be"),
    (False, lambda a: dict(cache_seqlens=a["cache_seqlens"].cpu() if a["q"].is_cuda else a["cache_seqlens"][None]),
     "cache_seqlens must be"),
    (True, lambda a: dict(cache_seqlens=40), "too small: sequence 0 needs 41"),
    (False, lambda a: dict(cache_seqlens=-1), "cache_seqlens\\[0\\] = -1 is negative"),
    (False, lambda a: dict(v=None), "k and v must be given together"),
    (False, lambda a: dict(k=a["k"][:, :, :1], v=a["v"][:, :, :1]), "k has \\(heads_kv, head_dim\\)"),
    (False, lambda a: dict(v=torch.cat([a["v"], a["v"]], 1)), "k and v must have the same shape"),
    (False, lambda a: dict(k=a["k"][:1], v=a["v"][:1]), "k and v must have the same shape \\(batch=2"),
    (False, lambda a: dict(k=a["k"].float(), v=a["v"].float()), "k and v must share q's dtype"),
    (False, lambda a: dict(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]), "needs block_table"),
    (True, lambda a: dict(k_cache=a["k_cache"][:, :8], v_cache=a["v_cache"][:, :8]), "multiple of 16"),
    (False, lambda a: dict(k_cache=a["k_cache"][0]), "k_cache must be a 4-D"),
    (False, lambda a: dict(v_cache=a["v_cache"][:, :20]), "k_cache and v_cache must have the same shape"),
    (False, lambda a: dict(k_cache=a["k_cache"].float(), v_cache=a["v_cache"].float()), "share a dtype"),
    (False, lambda a: dict(q=a["q"].requires_grad_()), "inference-only"),
    (False, lambda a: dict(num_splits=-1), "num_splits"),
    (False, lambda a: dict(window_size=(1,)), "window_size"),
    (False, lambda a: dict(cache_seqlens=a["cache_seqlens"].repeat_interleave(2)[::2]), "cache_seqlens must be contig"),
])
def test_bad_inputs_name_the_argument(paged, change, match, device, triton_path):
    args, paged_args = _bad_inputs(device)
    if paged:
        args.update(paged_args)
    args.update(change(args))
    caches = [args["k_cache"].clone(), args["v_cache"].clone()]
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], caches[0]) and torch.equal(args["v_cache"], caches[1]), "cache modified"


def test_repeated_calls_are_checked_as_the_first(device, triton_path, monkeypatch):
    """A decoding loop's later calls skip the checks that their signature (layouts, options) settles, and equal the
    fully checked call; what else a check reads (an int length's value, grad mode, autocast, FLASHFORMER_KERNEL)
    still raises on any call, before the caches change."""
    args, _ = _bad_inputs(device)
    for lengths in (args["cache_seqlens"], 39):
        args["cache_seqlens"] = lengths
        kvcache_checks.CHECKED_CALLS.clear()
        with torch.no_grad():
            checked = flash_attn_with_kvcache(**args, check_lengths=True)
            assert not kvcache_checks.CHECKED_CALLS, "a call that reads device values kept its checks"
            first = flash_attn_with_kvcache(**args)
            assert len(kvcache_checks.CHECKED_CALLS) == 1
            repeated = flash_attn_with_kvcache(**args)
        assert torch.equal(first, checked) and torch.equal(repeated, checked)
    caches = [args["k_cache"].clone(), args["v_cache"].clone()]
    with torch.no_grad(), pytest.raises(ValueError, match="too small: sequence 0 needs 41"):
        flash_attn_with_kvcache(**{**args, "cache_seqlens": 40})
    with torch.no_grad(), pytest.raises(ValueError, match="-1 is negative"):
        flash_attn_with_kvcache(**{**args, "cache_seqlens": -1})
    with pytest.raises(ValueError, match="inference-only"):
        flash_attn_with_kvcache(**{**args, "q": args["q"].clone().requires_grad_()})
    with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=torch.bfloat16), \
            pytest.raises(ValueError, match="k_cache and v_cache hold torch.float16"):
        flash_attn_with_kvcache(**args)
    monkeypatch.setenv("FLASHFORMER_KERNEL", "fastest")
    with torch.no_grad(), pytest.raises(ValueError, match="FLASHFORMER_KERNEL='fastest'"):
        flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], caches[0]) and torch.equal(args["v_cache"], caches[1]), "cache modified"


def test_caches_of_another_dtype_than_autocast_are_refused(device, triton_path):
    """torch.autocast casts q, k and v, never the caches (they are appended to in place): caches in another dtype
    raise, naming them, instead of reaching the kernels beside queries of another dtype."""
    args, _ = _bad_inputs(device)
    args = {**args, **{name: args[name].float() for name in ("q", "k", "v", "k_cache", "v_cache")}}
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16), pytest.raises(ValueError, match="k_cache"):
        flash_attn_with_kvcache(**args)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        for name in ("k_cache", "v_cache"):
            args[name] = args[name].bfloat16()
        assert flash_attn_with_kvcache(**args).dtype == torch.bfloat16


def test_grad_mode_off_allows_leaf_inputs(device, triton_path):
    args, _ = _bad_inputs(device)
    args["q"].requires_grad_()
    with torch.no_grad():
        assert flash_attn_with_kvcache(**args).shape == args["q"].shape


def test_fp32_is_exact(device, triton_path):
    case = Case((40, 9), 2, 2, (4, 2), 32, torch.float32, 16, device)
    out, _ = case.run()
    ref, _ = case.reference(True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_autocast_casts_new_inputs_to_the_cache_dtype(device, triton_path):
    case = Case((20, 3), 1, 1, (4, 2), 32, torch.bfloat16, None, device)
    case.q, case.k, case.v = case.q.float(), case.k.float(), case.v.float()
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        out, _ = case.run()
    assert out.dtype == torch.bfloat16
    case.assert_cache_appended()
    ref, _ = case.reference(True)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)


def _rotated(x, angles, positions, interleaved):
    """x (batch, seqlen, heads, head_dim) in fp64 with its first 2 * angles.shape[1] dims rotated by
    ``angles[positions]`` as complex multiplication: the pairs are (2i, 2i + 1) when interleaved, else
    (i, i + rotary_dim / 2)."""
    half = angles.shape[1]
    x = x.double()
    head = x[..., :2 * half]
    pairs = head.unflatten(-1, (half, 2)) if interleaved else head.unflatten(-1, (2, half)).transpose(-1, -2)
    turn = torch.polar(torch.ones_like(angles[positions].double()), angles[positions].double())[:, :, None]
    turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * turn)
    head = turned.flatten(-2) if interleaved else turned.transpose(-1, -2).flatten(-2)
    return torch.cat((head, x[..., 2 * half:]), dim=-1)


# (cache_seqlens as a tensor or an int, causal, window_size, rotary): every mask with every rotary layout
# (the query's positions depend on the mask), and int lengths with and without rotary.
# and ALiBi slopes (None, per head or per sequence) in two of them.
ROW_CASES = [("tensor", causal, window, rotary, None) for (causal, window), rotary in itertools.product(
    [(True, (-1, -1)), (False, (-1, -1)), (False, (6, 0))], [None, "interleaved", "neox"])] + [
    ("int", True, (-1, -1), None, None), ("int", False, (-1, -1), "neox", None),
    ("tensor", True, (-1, -1), "neox", (3, 4)), ("int", False, (6, 0), None, (4,))]


@pytest.mark.parametrize("lengths,causal,window_size,rotary,alibi_shape", ROW_CASES)
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_batch_idx_leftpad_rotary_match_reference(impl, lengths, causal, window_size, rotary, alibi_shape, device,
                                                  monkeypatch):
    """Sequences in chosen rows of a larger cache (cache_batch_idx), starting past left padding
    (cache_leftpad), with rotary embeddings on q and the new keys, against PyTorch math on the rows
    gathered, rotated and sliced by hand. Entries outside each sequence are NaN, and a cache of 40
    entries per row is no multiple of the kernel's pages. ALiBi's distances count from the left padding."""
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    monkeypatch.setattr(launch, "POISON_OUTPUTS", True)
    batch_cache, max_cache, (heads_q, heads_kv), head_dim, seqlen_q, seqlen_new = 5, 40, (4, 2), 32, 2, 2
    dtype = torch.float16
    rows = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)
    cached = [10, 0, 33] if lengths == "tensor" else [12] * 3
    leftpad = [3, 0, 30] if lengths == "tensor" else [3, 0, 11]
    batch = len(cached)
    k_cache = torch.full((batch_cache, max_cache, heads_kv, head_dim), float("nan"), device=device, dtype=dtype)
    v_cache = k_cache.clone()
    for b, (row, start, end) in enumerate(zip(rows.tolist(), leftpad, cached)):
        k_cache[row, start:end] = torch.randn(end - start, heads_kv, head_dim, device=device, dtype=dtype)
        v_cache[row, start:end] = torch.randn(end - start, heads_kv, head_dim, device=device, dtype=dtype)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(batch, seqlen_new, heads_kv, head_dim, device=device, dtype=dtype) for _ in range(2))
    rotary_args, q_ref, k_ref = {}, q.double(), k.double()
    if rotary is not None:
        angles = torch.rand(max_cache, 8, device=device) * 6.3  # rotary_dim 16 of head_dim 32
        rotary_args = dict(rotary_cos=angles.cos(), rotary_sin=angles.sin(), rotary_interleaved=rotary == "interleaved")
        first = torch.tensor(cached, device=device)[:, None]
        new_positions = first + torch.arange(seqlen_new, device=device)
        q_positions = first + torch.arange(seqlen_q, device=device) if causal or window_size != (-1, -1) else first
        q_ref = _rotated(q, angles, q_positions, rotary == "interleaved")
        k_ref = _rotated(k, angles, new_positions, rotary == "interleaved")
    gathered_k, gathered_v = k_cache[rows.long()].double(), v_cache[rows.long()].double()
    for b, end in enumerate(cached):
        gathered_k[b, end:end + seqlen_new], gathered_v[b, end:end + seqlen_new] = k_ref[b], v[b].double()
    before = k_cache.clone(), v_cache.clone()
    cache_seqlens = torch.tensor(cached, dtype=torch.int32, device=device) if lengths == "tensor" else cached[0]
    alibi = None if alibi_shape is None else torch.rand(alibi_shape, device=device)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cache_batch_idx=rows,
                                  cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device=device),
                                  causal=causal, window_size=window_size, alibi_slopes=alibi, **rotary_args)
    for b, (start, end) in enumerate(zip(leftpad, cached)):
        keys = slice(start, end + seqlen_new)
        tensors = (q_ref[b:b + 1], gathered_k[b:b + 1, keys], gathered_v[b:b + 1, keys])
        opts = dict(causal=causal, window_size=window_size,
                    alibi_slopes=alibi if alibi is None or alibi.dim() == 1 else alibi[b:b + 1])
        ref, _ = attention_materialized(*tensors, **opts)
        lowp, _ = attention_materialized(*(t.to(dtype) for t in tensors), upcast=False, **opts)
        assert_within_2x(f"out of sequence {b}", out[b:b + 1], ref, lowp)
    appended = torch.zeros(batch_cache, max_cache, dtype=torch.bool, device=device)
    for b, (row, end) in enumerate(zip(rows.tolist(), cached)):
        appended[row, end:end + seqlen_new] = True
        torch.testing.assert_close(k_cache[row, end:end + seqlen_new].double(), k_ref[b], atol=2e-3, rtol=0)
        assert torch.equal(v_cache[row, end:end + seqlen_new], v[b])
    for cache, old in zip((k_cache, v_cache), before):
        torch.testing.assert_close(cache[~appended], old[~appended], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_rotary_is_applied_before_the_append(impl, device, monkeypatch):
    """An identity rotation (angle 0) changes nothing: the call equals the one without rotary."""
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    args, _ = _bad_inputs(device)
    runs = []
    for rotary in ({}, dict(rotary_cos=torch.ones(40, 16, device=device), rotary_sin=torch.zeros(40, 16,
                                                                                                  device=device))):
        caches = {name: args[name].clone() for name in ("k_cache", "v_cache")}
        runs.append((flash_attn_with_kvcache(**{**args, **caches}, **rotary), caches))
    (out_plain, caches_plain), (out_rotary, caches_rotary) = runs
    assert torch.equal(out_plain, out_rotary)
    assert all(torch.equal(caches_plain[name], caches_rotary[name]) for name in caches_plain)


def _angles(device, positions=40, half=8):
    angles = torch.rand(positions, half, device=device)
    return dict(rotary_cos=angles.cos(), rotary_sin=angles.sin())


@pytest.mark.parametrize("paged,change,match", [
    (True, lambda a: dict(cache_batch_idx=_i32(a, 0, 1)), "cache_batch_idx applies to a contiguous cache"),
    (True, lambda a: dict(cache_leftpad=_i32(a, 0, 1)), "cache_leftpad applies to a contiguous cache"),
    (False, lambda a: dict(cache_batch_idx=_i32(a, 0, 1).long()), "cache_batch_idx must be an int32"),
    (False, lambda a: dict(cache_leftpad=_i32(a, 0, 0, 1, 1)[::2]), "cache_leftpad must be contiguous"),
    (False, lambda a: dict(cache_leftpad=_i32(a, 0)), "cache_leftpad must be an int32 tensor of shape \\(batch=2"),
    (False, lambda a: dict(rotary_cos=_angles(a["q"].device)["rotary_cos"]), "rotary_cos and rotary_sin"),
    (False, lambda a: dict(k=None, v=None, **_angles(a["q"].device)), "need k and v"),
    (False, lambda a: dict(**_angles(a["q"].device, half=17)), "rotary_dim = 2 \\* 17"),
    (False, lambda a: dict(**_angles(a["q"].device, positions=39)), "rotary_cos has 39 positions"),
    (False, lambda a: dict(rotary_interleaved=1), "rotary_interleaved must be a bool"),
    (False, lambda a: dict(q=a["q"][..., :20], k=a["k"][..., :20], v=a["v"][..., :20],
                           k_cache=a["k_cache"][..., :20], v_cache=a["v_cache"][..., :20]), "head_dim=20"),
    (False, lambda a: dict(v=torch.randn(2, 1, 2, 24, dtype=a["v"].dtype, device=a["v"].device)),
     "v has \\(heads_kv, head_dim\\)"),
    (False, lambda a: dict(k_cache=a["k_cache"][:1, :8], v_cache=a["v_cache"][:1, :8], cache_seqlens=3,
                           cache_batch_idx=_i32(a, 0, 0)), "at least 16 entries in all .*, got 8"),
])
def test_new_kvcache_arguments_name_themselves(paged, change, match, device, triton_path):
    args, paged_args = _bad_inputs(device)
    if paged:
        args.update(paged_args)
    args.update(change(args))
    caches = [args["k_cache"].clone(), args["v_cache"].clone()]
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], caches[0]) and torch.equal(args["v_cache"], caches[1]), "cache modified"


@pytest.mark.parametrize("change,match", [
    (lambda a: dict(cache_batch_idx=_i32(a, 0, 2), k_cache=a["k_cache"][:2], v_cache=a["v_cache"][:2]),
     "cache_batch_idx has 1 entries outside \\[0, k_cache rows=2\\)"),
    (lambda a: dict(cache_leftpad=_i32(a, 4, 0)), "cache_leftpad has 1 entries outside"),
    (lambda a: dict(cache_leftpad=_i32(a, 0, -1), cache_seqlens=5), "cache_leftpad has 1 entries outside"),
])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_bad_rows_and_leftpad_are_caught_when_checked(impl, change, match, device, monkeypatch):
    monkeypatch.setenv("FLASHFORMER_KERNEL", impl)
    args, _ = _bad_inputs(device)
    args.update(change(args))
    for check in (True, None) if impl == "torch" else (True,):
        with pytest.raises(ValueError, match=match):
            flash_attn_with_kvcache(**args, check_lengths=check)
    if impl == "torch":
        with pytest.raises(ValueError, match="check_lengths=False"):
            flash_attn_with_kvcache(**args, check_lengths=False)


def test_rows_leftpad_rotary_compile_full_graph(device, triton_path):
    """cache_batch_idx, cache_leftpad and rotary trace with no graph break and compute the eager result."""
    args, _ = _bad_inputs(device)
    args.update(k_cache=torch.randn(4, 40, 2, 32, device=device, dtype=torch.float16), **_angles(device),
                cache_batch_idx=_i32(args, 3, 1), cache_leftpad=_i32(args, 1, 4))
    caches = [args.pop(name) for name in ("k_cache", "v_cache")]
    caches[1] = torch.randn_like(caches[0])

    def step(k_cache, v_cache):
        return flash_attn_with_kvcache(k_cache=k_cache, v_cache=v_cache, **args)

    eager = step(*(c.clone() for c in caches))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*(c.clone() for c in caches))
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_flash_attn_positional_order_and_lse_name(device, triton_path):
    """A call written for flash-attn's signature, positionally up to causal and with its
    return_softmax_lse, equals the keyword call with return_lse."""
    args, _ = _bad_inputs(device)
    angles = _angles(device)
    runs = []
    for positional in (True, False):
        caches = {name: args[name].clone() for name in ("k_cache", "v_cache")}
        if positional:
            runs.append(flash_attn_with_kvcache(args["q"], caches["k_cache"], caches["v_cache"], args["k"], args["v"],
                                                angles["rotary_cos"], angles["rotary_sin"], args["cache_seqlens"],
                                                None, None, None, 0.3, False, return_softmax_lse=True))
        else:
            runs.append(flash_attn_with_kvcache(**{**args, **caches}, **angles, softmax_scale=0.3, causal=False,
                                                return_lse=True))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
