"""The Triton kernels (fwd + bwd) against fp64 math, by flash-attn's 2x rule, over a shape sweep.

On CPU they run in Triton's interpreter: the default selection is small; ``-m slow`` (run on the GPU)
adds the full product of shapes, head dims, GQA ratios, masks and dtypes.
"""

import functools
import itertools
import os
import random
import subprocess
import sys

import pytest
import torch
from attention_checks import assert_compiles_full_graph, assert_matches_reference, assert_within_2x, attention_grads

from flashformer.kernels import attention_materialized, flash_attn_func, flash_attn_with_kvcache

SEQLENS = [(1, 1), (113, 203), (128, 217), (239, 1), (1023, 1024), (1024, 1023), (64, 128), (200, 57)]
HEAD_DIMS = [40, 64, 80, 128, 256]
HEADS = [(8, 8), (8, 2), (8, 1)]
MASKS = [  # (causal, window_size, softcap)
    (False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (False, (32, 8), 0.0), (True, (17, -1), 0.0),
    (False, (-1, -1), 15.0), (True, (40, -1), 5.0),
]
DTYPES = [torch.float16, torch.bfloat16]

# A CPU-sized selection: every value of every axis but the head counts appears, pairs chosen to cover the
# edge cases (single key, seqlen_k < seqlen_q with causal, partial tiles, GQA with windows, softcap in bf16).
# The interpreter runs one program per (tile, head, batch) in turn, so its head counts are the smallest
# of each kind: no grouping, groups over several KV heads, one KV head (the full sweep has 8 query heads).
QUICK = [
    # seqlens,   head_dim, heads,  mask, dtype
    ((1, 1), 64, (2, 2), 1, 0),
    ((113, 203), 40, (4, 2), 1, 1),
    ((113, 203), 80, (2, 2), 0, 0),
    ((128, 217), 64, (4, 1), 2, 1),
    ((239, 1), 64, (4, 2), 1, 0),
    ((239, 1), 128, (2, 2), 0, 1),
    ((200, 57), 128, (4, 2), 3, 0),
    ((64, 128), 256, (2, 2), 1, 1),
    ((113, 203), 64, (2, 2), 4, 1),
    ((128, 217), 40, (4, 2), 5, 0),
    ((200, 57), 80, (4, 1), 1, 1),
    ((64, 128), 128, (4, 1), 5, 1),
]


def _case_id(seqlens, head_dim, heads, mask, dtype):
    causal, window, softcap = MASKS[mask]
    return (f"s{seqlens[0]}x{seqlens[1]}-d{head_dim}-h{heads[0]}:{heads[1]}-"
            f"{'causal' if causal else 'full'}-w{window[0]},{window[1]}-cap{softcap:g}-{str(DTYPES[dtype])[6:]}")


QUICK_CASES = [pytest.param(*c, id=_case_id(*c)) for c in QUICK]
FULL_CASES = [
    pytest.param(*c, id=_case_id(*c), marks=pytest.mark.slow)
    for c in itertools.product(SEQLENS, HEAD_DIMS, HEADS, range(len(MASKS)), range(len(DTYPES)))
    if c not in QUICK
]


@pytest.mark.parametrize("seqlens,head_dim,heads,mask,dtype", QUICK_CASES + FULL_CASES)
def test_flash_matches_reference(seqlens, head_dim, heads, mask, dtype, device, triton_path):
    (seqlen_q, seqlen_k), (heads_q, heads_kv) = seqlens, heads
    causal, window_size, softcap = MASKS[mask]
    dtype = DTYPES[dtype]
    batch = 2 if seqlen_q * seqlen_k < 50_000 else 1
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device=device, dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, device=device, dtype=dtype)
    grad_out = torch.randn_like(q)
    opts = dict(causal=causal, window_size=window_size, softcap=softcap)
    assert_matches_reference(flash_attn_func, q, k, v, grad_out, **opts)


# deterministic=False: the dK/dV kernel also accumulates dQ (atomics). Quick cases on CPU cover GQA,
# windows, softcap, single keys and head_dim 256; the slow selection runs every mask, head_dim and
# length at GQA 8:2 in bf16.
NONDETERMINISTIC_QUICK = [QUICK[i] for i in (1, 3, 4, 6, 7, 9)]
NONDETERMINISTIC_CASES = [pytest.param(*c, id=_case_id(*c)) for c in NONDETERMINISTIC_QUICK] + [
    pytest.param(*c, id=_case_id(*c), marks=pytest.mark.slow)
    for c in itertools.product(SEQLENS, HEAD_DIMS, [(8, 2)], range(len(MASKS)), [1])
    if c not in NONDETERMINISTIC_QUICK
]


@pytest.mark.parametrize("seqlens,head_dim,heads,mask,dtype", NONDETERMINISTIC_CASES)
def test_nondeterministic_backward_matches_reference(seqlens, head_dim, heads, mask, dtype, device, triton_path):
    (seqlen_q, seqlen_k), (heads_q, heads_kv) = seqlens, heads
    causal, window_size, softcap = MASKS[mask]
    dtype = DTYPES[dtype]
    q = torch.randn(2, seqlen_q, heads_q, head_dim, device=device, dtype=dtype)
    k = torch.randn(2, seqlen_k, heads_kv, head_dim, device=device, dtype=dtype)
    v = torch.randn(2, seqlen_k, heads_kv, head_dim, device=device, dtype=dtype)
    grad_out = torch.randn_like(q)
    assert_matches_reference(functools.partial(flash_attn_func, deterministic=False), q, k, v, grad_out,
                             causal=causal, window_size=window_size, softcap=softcap)


def test_deterministic_must_be_a_bool():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        flash_attn_func(q, q, q, deterministic="yes")


def test_lse_and_empty_rows(device, triton_path):
    """A window that leaves rows without keys: those rows output 0, lse -inf, gradient 0."""
    q = torch.randn(1, 70, 2, 32, device=device, dtype=torch.float16)
    k = torch.randn(1, 40, 2, 32, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    opts = dict(causal=True, window_size=(3, -1))  # rows 0..29 see no key (bottom-right alignment)
    out, lse = flash_attn_func(q, k, v, return_lse=True, **opts)
    _, ref_lse = attention_materialized(q.double(), k.double(), v.double(), **opts)
    seen = torch.isfinite(ref_lse)
    assert not seen[:, :, :30].any() and seen[:, :, 30:].all()
    assert torch.equal(torch.isneginf(lse), ~seen)
    torch.testing.assert_close(lse[seen], ref_lse[seen].float(), atol=2e-3, rtol=0)
    assert (out[:, :30] == 0).all()
    dq, dk, dv = attention_grads(flash_attn_func, q, k, v, torch.randn_like(q), **opts)[1:]
    assert (dq[:, :30] == 0).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()


def test_lse_gradient(device, triton_path):
    """A loss on lse (as ring attention's merge produces) backpropagates exactly."""
    q, k, v = (torch.randn(1, 50, 2, 64, device=device, dtype=torch.float16) for _ in range(3))

    def loss_of(fn, tensors, **kw):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        out, lse = fn(*leaves, causal=True, **kw) if fn is attention_materialized else fn(
            *leaves, causal=True, return_lse=True)
        (out.float().sum() + (lse.float() * torch.linspace(-1, 1, lse.numel(), device=device).view_as(lse)).sum()).backward()
        return [t.grad for t in leaves]

    ours = loss_of(flash_attn_func, (q, k, v))
    ref = loss_of(attention_materialized, (q.double(), k.double(), v.double()))
    lowp = loss_of(attention_materialized, (q, k, v), upcast=False)
    for name, a, r, l in zip(("dq", "dk", "dv"), ours, ref, lowp):
        assert_within_2x(name, a, r, l)


def test_backward_is_deterministic(device, triton_path):
    # A GPU runs its programs at once, in varying order; the interpreter runs them in turn, so a few suffice.
    batch, seqlen, heads = (2, 150, 8) if device == "cuda" else (1, 100, 4)
    q = torch.randn(batch, seqlen, heads, 64, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, 2, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
    grad_out = torch.randn_like(q)
    first = attention_grads(flash_attn_func, q, k, v, grad_out, causal=True)
    second = attention_grads(flash_attn_func, q, k, v, grad_out, causal=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_non_contiguous_fused_qkv(device, triton_path):
    """Slices of a fused (batch, seqlen, 3, heads, head_dim) projection, used without a copy."""
    qkv = torch.randn(2, 97, 3, 4, 48, device=device, dtype=torch.float16)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    grad_out = torch.randn_like(q)
    assert_matches_reference(flash_attn_func, q, k, v, grad_out, causal=True)


def _unaligned(shape, device, offset=3):
    """Random fp16 values in a contiguous view ``offset`` elements into its storage: a base address that is not a
    multiple of 16 bytes, which TMA descriptors cannot take."""
    storage = torch.randn(offset + torch.Size(shape).numel(), device=device, dtype=torch.float16)
    view = storage[offset:].view(shape)
    assert view.is_contiguous() and view.data_ptr() % 16
    return view


def test_unaligned_inputs_run_as_aligned_copies(device, triton_path):
    """Contiguous inputs at an unaligned base address (a slice into a flat buffer) give the result of their aligned
    copies, forward and backward; so does a cache at such an address under flash_attn_with_kvcache."""
    q, k, v = (_unaligned((2, 41, 4, 32), device, offset).requires_grad_() for offset in (3, 5, 1))
    grad_out = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=True)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad_out))
    expected = attention_grads(flash_attn_func, q, k, v, grad_out, causal=True)  # on aligned copies
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    q, k, v = (t.detach() for t in (q, k, v))
    k_cache, v_cache = _unaligned((2, 48, 2, 32), device), _unaligned((2, 48, 2, 32), device, 7)
    q, k_new, v_new = q[:, :2], k[:, :2, :2].contiguous(), v[:, :2, :2].contiguous()
    lengths = torch.tensor([5, 30], dtype=torch.int32, device=device)
    with torch.no_grad():
        aligned = [k_cache.clone(), v_cache.clone()]
        expected = flash_attn_with_kvcache(q, *aligned, k_new, v_new, cache_seqlens=lengths, causal=True)
        got = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True)
    assert torch.equal(got, expected)
    assert torch.equal(k_cache, aligned[0]) and torch.equal(v_cache, aligned[1]), "the append missed the caches"


def test_fp32_inputs_are_exact(device, triton_path):
    q, k, v = (torch.randn(1, 77, 2, 32, device=device) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    ref, _ = attention_materialized(q.double(), k.double(), v.double(), causal=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_autocast(device, triton_path):
    """Under autocast, inputs of mixed float dtypes (fp32 q and k out of a qk-norm, bf16 v out of a
    linear) run in the autocast dtype, as SDPA's do."""
    dtype = torch.bfloat16
    q, k, v = (torch.randn(1, 33, 2, 32, device=device) for _ in range(3))
    with torch.autocast(device_type=device, dtype=dtype):
        out = flash_attn_func(q, k, v, causal=True)
        mixed = flash_attn_func(q, k, v.to(dtype), causal=True)
    assert out.dtype == mixed.dtype == dtype
    assert torch.equal(out, mixed)
    ref, _ = attention_materialized(q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double(), causal=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)


def test_torch_compile_full_graph(device, triton_path):
    """Forward and backward are torch.library nodes with fakes: fullgraph compile (no graph break)."""
    assert_compiles_full_graph(device)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="tensors over 2**31 elements: ~40 GB of GPU memory")
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "varlen"])
def test_offsets_past_2_to_the_31_elements(packed):
    """Sequences that start past element 2**31 of q, k, v (and of the gradients) are read and written
    where they are: the kernels' base offsets are 64-bit. Checked against the same sequences alone."""
    from flashformer.kernels import flash_attn_varlen_func

    seqlen, heads, head_dim = 128, 8, 256
    batch = 2**31 // (seqlen * heads * head_dim) + 4  # the last 4 sequences lie past 2**31 elements
    q, k, v, grad_out = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    if packed:
        cu_seqlens = torch.arange(0, batch * seqlen + 1, seqlen, device="cuda", dtype=torch.int32)
        out = flash_attn_varlen_func(*(t.flatten(0, 1) for t in (q, k, v)), cu_seqlens, cu_seqlens, causal=True)
        out = out.view_as(q)
    else:
        out = flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    tail = slice(batch - 4, batch)
    q_t, k_t, v_t = (t[tail].detach().clone().requires_grad_() for t in (q, k, v))
    out_t = flash_attn_func(q_t, k_t, v_t, causal=True)
    grads_t = torch.autograd.grad(out_t, (q_t, k_t, v_t), grad_out[tail])
    for name, ours, alone in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_t, *grads_t)):
        torch.testing.assert_close(ours[tail], alone, atol=1e-2, rtol=1e-2, msg=name)


# A key tile that runs past seqlen_k holds zero rows of K and V (the descriptors' fill). Their logits are
# 0, so any query tile the dK/dV pass left unmasked would give them p = exp2(-lse): with very negative
# scores (lse << 0) dS overflows there and inf x 0 (the zero keys) turns dQ into NaN.
@pytest.mark.parametrize("deterministic", [False, True], ids=["nondeterministic", "deterministic"])
def test_one_key_with_a_very_negative_score(deterministic, device, triton_path):
    """Every row's only score is -32 (lse = -32): the exact dq is 0."""
    q = torch.full((1, 64, 1, 64), 2.0, device=device, dtype=torch.float16)
    k = torch.full((1, 1, 1, 64), -2.0, device=device, dtype=torch.float16)
    v = torch.randn(1, 1, 1, 64, device=device, dtype=torch.float16)
    assert_matches_reference(functools.partial(flash_attn_func, deterministic=deterministic), q, k, v,
                             torch.ones_like(q))


@pytest.mark.parametrize("deterministic", [False, True], ids=["nondeterministic", "deterministic"])
def test_softcap_one_key_head_dim_256(deterministic, device, triton_path):
    """softcap 15 bounds the logits to [-15, 15]; scores near -15 still overflow unmasked padded keys."""
    q = 3 * torch.randn(1, 96, 4, 256, device=device, dtype=torch.float16)
    k = 3 * torch.randn(1, 1, 2, 256, device=device, dtype=torch.float16)
    # Integer v and dO: with one key the exact dq and dk are 0, and the kernel gets them from
    # dS = P * (dP - delta), two fp32 sums of the same 256 products of size ~|v||dO|. With integers
    # (|sums| < 2^24) both sums are exact in any order, on the tensor cores too, so dS is exactly 0;
    # with 3 * randn they differed by rounding, ~9e-5 in dk on the CPU, against the 1e-4 floor of
    # exact zeros, and more in the tensor cores' summation order.
    v = (3 * torch.randn(1, 1, 2, 256, device=device)).round().to(torch.float16)
    grad_out = (2 * torch.randn(q.shape, device=device)).round().to(torch.float16)
    assert_matches_reference(functools.partial(flash_attn_func, deterministic=deterministic), q, k, v,
                             grad_out, softcap=15.0)


# seqlen_k drawn once (fixed seed: every run sweeps the same) from lengths that no power-of-two key tile
# of 16 or more divides; seqlen_q >= 64 leaves whole query tiles (the unmasked kind) at every tile size
# the interpreter uses. Full attention and a left-only window leave query tiles unmasked for the last key
# tile, causal does not; head_dim 128 takes the deterministic dK/dV pass's one-loop form.
_SWEEP_RNG = random.Random(20261201)
_PARTIAL_KEY_TILE_MASKS = [("full", (False, (-1, -1))), ("left48", (False, (48, -1))), ("causal", (True, (-1, -1)))]
PARTIAL_KEY_TILE_CASES = [
    pytest.param(seqlens, head_dim, *mask, id=f"s{seqlens[0]}x{seqlens[1]}-d{head_dim}-{name}")
    for seqlens, head_dim, (name, mask) in [
        ((_SWEEP_RNG.randint(64, 200), _SWEEP_RNG.choice([n for n in range(1, 300) if n % 16])), (64, 128)[i % 2],
         _PARTIAL_KEY_TILE_MASKS[i % 3]) for i in range(6)]
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["nondeterministic", "deterministic"])
@pytest.mark.parametrize("seqlens,head_dim,causal,window_size", PARTIAL_KEY_TILE_CASES)
def test_partial_key_tile_with_negative_scores(seqlens, head_dim, causal, window_size, deterministic, device,
                                               triton_path):
    """q and k point in opposite directions, so every score is very negative (about -30)."""
    seqlen_q, seqlen_k = seqlens
    offset = 30**0.5 / head_dim**0.25  # q.k * scale is about -offset**2 * sqrt(head_dim) = -30
    dtype = torch.float16
    q = (torch.randn(1, seqlen_q, 2, head_dim, device=device) + offset).to(dtype)
    k = (torch.randn(1, seqlen_k, 1, head_dim, device=device) - offset).to(dtype)
    v = torch.randn(1, seqlen_k, 1, head_dim, device=device, dtype=dtype)
    assert_matches_reference(functools.partial(flash_attn_func, deterministic=deterministic), q, k, v,
                             torch.randn_like(q), causal=causal, window_size=window_size)


# A fresh interpreter with an empty Triton cache, so that the autotuner really times the candidates
# (its results are cached in memory and on disk): the forward's config is forced, the dQ-accumulating
# backward is tuned (softcap keeps it off the offline table), then checked by the 2x rule.
AUTOTUNED_DQ_CHECK = """
import functools, sys
import torch
sys.path.insert(0, sys.argv[1])
from attention_checks import assert_matches_reference
from flashformer.kernels import flash_attn_func, tuning

tuning.FORCED_CONFIGS["fwd"] = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
torch.manual_seed(0)
q = torch.randn(1, 300, 4, 256, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(1, 300, 2, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
assert_matches_reference(functools.partial(flash_attn_func, deterministic=False), q, k, v, torch.randn_like(q),
                         softcap=15.0)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the autotuner runs on CUDA only")
def test_autotuned_nondeterministic_backward_first_call(tmp_path):
    """The autotuner times each candidate by running it many times on the call's own dQ buffer, which
    the kernel adds into: the first call of a shape must still return the exact dQ."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "FLASHFORMER_AUTOTUNE": "1",
           "FLASHFORMER_KERNEL": "triton"}
    result = subprocess.run([sys.executable, "-c", AUTOTUNED_DQ_CHECK, os.path.dirname(__file__)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("seqlen_q", [1, 127, 128, 200])
def test_row_statistics_are_padded_with_rows_that_add_nothing(seqlen_q):
    """The dK/dV kernels load a query tile's statistics unmasked: each head's rows (dense, a sequence's; packed,
    all the sequences' in one run, up to 3 rows apart) go on to a multiple of STATS_ROWS, the padding
    lse_log2 = +inf and delta = 0, so that each head's run starts 16-byte aligned for the Gluon kernel's TMA
    copies."""
    from flashformer.kernels import bwd_stats

    rows = bwd_stats.STATS_ROWS.value
    for lse, is_varlen, (batch, heads, length) in ((torch.randn(2, 3, seqlen_q), False, (2, 3, seqlen_q)),
                                                   (torch.randn(3, 5 * seqlen_q), True, (1, 3, 5 * seqlen_q + 15))):
        lse_log2, delta, strides = bwd_stats.row_stats_buffers(lse, seqlen_q, is_varlen, num_seqs=5)
        padded = -(-length // rows) * rows
        assert lse_log2.shape == delta.shape == (batch, heads, padded)
        assert strides == (0 if is_varlen else heads * padded, padded)
        assert lse_log2.data_ptr() % 16 == 0 and delta.data_ptr() % 16 == 0
        if padded > length:
            tail = (lse_log2[..., length:], delta[..., length:])
            assert torch.isinf(tail[0]).all() and tail[0].gt(0).all() and tail[1].eq(0).all()
