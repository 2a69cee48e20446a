"""The public API around the kernels: argument checks, path choice, and the PyTorch (CPU) path."""

import functools
import subprocess
import sys

import pytest
import torch
from attention_checks import assert_matches_reference

from flashformer.kernels import flash_attn_func, interface, kernel_impl
from flashformer.kernels import reference, settings


def _qkv(batch=1, seqlen_q=16, seqlen_k=16, heads_q=4, heads_kv=2, head_dim=32, dtype=torch.float16):
    return (torch.randn(batch, seqlen_q, heads_q, head_dim, dtype=dtype),
            torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype),
            torch.randn(batch, seqlen_k, heads_kv, head_dim, dtype=dtype))


@pytest.mark.parametrize("mutate,match", [
    (lambda q, k, v: (q[0], k, v), "q must have 4 dims"),
    (lambda q, k, v: (q, k[..., :16], v[..., :16]), "head_dim of q"),
    (lambda q, k, v: (q, k, v[:, :8]), "k and v must have the same shape"),
    (lambda q, k, v: (torch.cat([q, q]), k, v), "disagree in batch"),
    (lambda q, k, v: (q[:, :, :3], k, v), "multiple of heads"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), "dtype"),
    (lambda q, k, v: (q, k.float(), v.float()), "share a dtype"),
    (lambda q, k, v: (q[..., :0], k[..., :0], v[..., :0]), "head_dim=0"),
    (lambda q, k, v: (q, k, torch.randn(*v.shape[:-1], 257, dtype=v.dtype)), "head_dim of v=257"),
    (lambda q, k, v: (q.to("meta"), k, v), "one device"),
    (lambda q, k, v: (q.numpy(), k, v), "q must be a torch.Tensor"),
])
def test_bad_tensors_name_the_argument(mutate, match):
    with pytest.raises(ValueError, match=match):
        flash_attn_func(*mutate(*_qkv()))


@pytest.mark.parametrize("kwargs,match", [
    (dict(window_size=(3,)), "window_size"),
    (dict(window_size=(-2, 0)), "window_size"),
    (dict(window_size=(1.5, 0)), "window_size"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("inf")), "softcap"),
    (dict(softcap=float("nan")), "softcap"),
    (dict(softmax_scale=0.0), "softmax_scale"),
    (dict(softmax_scale=float("nan")), "softmax_scale"),
    (dict(softmax_scale=float("inf")), "softmax_scale"),
])
def test_bad_options_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        flash_attn_func(*_qkv(), **kwargs)


def test_path_choice_is_one_switch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("FLASHFORMER_KERNEL", "torch")
    assert kernel_impl(cpu) == "torch"
    monkeypatch.setenv("FLASHFORMER_KERNEL", "triton")
    monkeypatch.setattr(settings, "INTERPRETED", True)  # TRITON_INTERPRET=1 when the kernels were imported
    assert kernel_impl(cpu) == "triton"
    monkeypatch.setattr(settings, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kernel_impl(cpu)
    monkeypatch.setenv("FLASHFORMER_KERNEL", "gluon")
    with pytest.raises(ValueError, match="sm_90"):
        kernel_impl(cpu)
    monkeypatch.setenv("FLASHFORMER_KERNEL", "auto")
    assert kernel_impl(cpu) == kernel_impl("cpu") == "torch"
    assert kernel_impl() == kernel_impl("cuda" if torch.cuda.is_available() else "cpu")  # no device: the current one
    # CUDA: the Gluon path by default only where its kernels were tested (an sm_90 GPU, a listed Triton).
    cuda = torch.device("cuda", 0)
    expected = "gluon" if interface.hopper_gluon_available(0) else "triton"
    assert kernel_impl(cuda) == expected
    monkeypatch.setenv("FLASHFORMER_KERNEL", "cuda")
    with pytest.raises(ValueError, match="FLASHFORMER_KERNEL"):
        kernel_impl(cpu)


@pytest.mark.parametrize("seqlens", [(1, 1), (700, 1100), (1100, 700), (300, 300)])
@pytest.mark.parametrize("causal,window_size,softcap", [
    (False, (-1, -1), 0.0), (True, (-1, -1), 0.0), (True, (100, -1), 0.0), (False, (64, 600), 20.0)])
def test_torch_path_matches_reference(seqlens, causal, window_size, softcap, monkeypatch):
    """The tiled CPU path (tiles smaller than the sequences) against the materialized fp64 math."""
    monkeypatch.setenv("FLASHFORMER_KERNEL", "torch")
    q, k, v = _qkv(2, *seqlens, heads_q=4, heads_kv=2, head_dim=32, dtype=torch.bfloat16)
    grad_out = torch.randn_like(q)
    opts = dict(causal=causal, window_size=window_size, softcap=softcap)
    assert_matches_reference(flash_attn_func, q, k, v, grad_out, **opts)


def test_torch_path_memory_is_linear():
    """8k tokens: a materialized score matrix would take 256 MiB; the tiled path stays far below."""
    seqlen = 8192
    script = (
        "import resource, torch\n"
        "from flashformer.kernels import flash_attn_func\n"
        f"q, k, v = (torch.randn(1, {seqlen}, 1, 16) for _ in range(3))\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "flash_attn_func(q, k, v, causal=True)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)\n"
    )
    env = {"FLASHFORMER_KERNEL": "torch", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    grown_mib = int(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                   check=True).stdout)
    scores_mib = seqlen * seqlen * 4 // 2**20
    assert grown_mib < scores_mib // 8, f"peak RSS grew {grown_mib} MiB (scores would be {scores_mib} MiB)"
    assert reference.MAX_TILE**2 * 4 < scores_mib * 2**20 // 64


def _entry_point_calls(device):
    """One call of every public entry point, with its inputs made up front (making them may copy from
    the host): dense and varlen forward + backward in both deterministic modes, their packed forms, a
    head_dim the kernels pad, varlen over paged keys (max_seqlen_k left None) and with seqused_k, decoding
    against contiguous and paged caches with tensor and int lengths, appending new tokens (several per
    sequence too, and a prompt long enough for the dense forward), with packed queries, rotary embeddings,
    chosen cache rows and left padding, and ALiBi over caches and paged keys."""
    from flashformer.kernels import (cu_seqlens_from_lengths, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                     flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                     flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
    from flashformer.kernels.decode import DENSE_QUERY_TILE, device_sms

    dtype = torch.bfloat16
    q, k, v = (torch.randn(2, 80, heads, 64, device=device, dtype=dtype) for heads in (4, 2, 2))
    lengths = [37, 0, 90, 33]
    packed_q, packed_k, packed_v = (t.flatten(0, 1)[:sum(lengths)] for t in (q, k, v))
    cu = cu_seqlens_from_lengths(lengths).to(device)
    cache_k, cache_v = (torch.randn(2, 128, 2, 64, device=device, dtype=dtype) for _ in range(2))
    pool_k, pool_v = (torch.randn(10, 16, 2, 64, device=device, dtype=dtype) for _ in range(2))
    table = torch.randperm(10, device=device)[:8].view(2, 4).int()
    cache_seqlens = torch.tensor([5, 40], dtype=torch.int32, device=device)
    step_q, step_k, step_v = (torch.randn(2, 1, heads, 64, device=device, dtype=dtype) for heads in (4, 2, 2))

    def grads(fn, *tensors, **kwargs):
        leaves = [t.detach().requires_grad_() for t in tensors]
        out = fn(*leaves, **kwargs)
        return torch.autograd.grad(out, leaves, torch.ones_like(out))

    calls = []
    slopes = torch.rand(4, device=device)
    for deterministic in (True, False):
        calls.append(functools.partial(grads, flash_attn_func, q, k, v, causal=True, deterministic=deterministic))
        calls.append(functools.partial(grads, flash_attn_varlen_func, packed_q, packed_k, packed_v,
                                       cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                                       max_seqlen_k=max(lengths), deterministic=deterministic))
        # dropout's seed is drawn and read on the device
        calls.append(functools.partial(grads, flash_attn_func, q, k, v, causal=True, deterministic=deterministic,
                                       dropout_p=0.1, alibi_slopes=slopes))
    qkv = torch.stack((q, k.repeat(1, 1, 2, 1), v.repeat(1, 1, 2, 1)), dim=2)
    kv = torch.stack((k, v), dim=2)
    calls.append(functools.partial(grads, flash_attn_qkvpacked_func, qkv, causal=True))
    calls.append(functools.partial(grads, flash_attn_kvpacked_func, q, kv, causal=True))
    calls.append(functools.partial(grads, flash_attn_varlen_qkvpacked_func, qkv.flatten(0, 1)[:sum(lengths)],
                                   cu_seqlens=cu, max_seqlen=max(lengths)))
    calls.append(functools.partial(grads, flash_attn_varlen_kvpacked_func, packed_q, kv.flatten(0, 1)[:sum(lengths)],
                                   cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                                   max_seqlen_k=max(lengths)))
    calls.append(functools.partial(grads, flash_attn_func, q[..., :59], k[..., :59], v[..., :40], causal=True))
    chunk_cu = cu_seqlens_from_lengths([3, 9]).to(device)
    calls.append(functools.partial(flash_attn_varlen_func, packed_q[:12], pool_k, pool_v, chunk_cu,
                                   cu_seqlens_from_lengths([40, 64]).to(device), 9, block_table=table, causal=True))
    calls.append(functools.partial(flash_attn_varlen_func, packed_q[:12], pool_k, pool_v, chunk_cu,
                                   cu_seqlens_from_lengths([40, 64]).to(device), 9, block_table=table, causal=True,
                                   alibi_slopes=slopes))
    calls.append(functools.partial(grads, flash_attn_varlen_func, packed_q, packed_k, packed_v, cu_seqlens_q=cu,
                                   cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
                                   seqused_k=torch.tensor([30, 0, 90, 1], dtype=torch.int32, device=device)))
    chunk_q, chunk_k, chunk_v = (torch.randn(2, 5, heads, 64, device=device, dtype=dtype) for heads in (4, 2, 2))
    for caches, block_table in (((cache_k, cache_v), None), ((pool_k, pool_v), table)):
        for lengths_given in (cache_seqlens, 20):
            calls.append(functools.partial(flash_attn_with_kvcache, step_q, *caches, k=step_k, v=step_v,
                                           cache_seqlens=lengths_given, block_table=block_table))
        calls.append(functools.partial(flash_attn_with_kvcache, chunk_q, *caches, k=chunk_k, v=chunk_v,
                                       cache_seqlens=cache_seqlens, block_table=block_table))
        calls.append(functools.partial(flash_attn_with_kvcache, step_q, *caches, k=step_k, v=step_v,
                                       cache_seqlens=cache_seqlens, block_table=block_table,
                                       alibi_slopes=slopes.expand(2, 4).contiguous()))
    # a prompt over the cache, long enough that dense_forward_pays: the dense forward over the rows in use
    prompt = DENSE_QUERY_TILE * -(-device_sms(torch.device(device)) // 8)
    prompt_q, prompt_k, prompt_v = (torch.randn(2, prompt, heads, 64, device=device, dtype=dtype)
                                    for heads in (4, 2, 2))
    prompt_caches = [torch.randn(2, prompt + 64, 2, 64, device=device, dtype=dtype) for _ in range(2)]
    for lengths_given in (cache_seqlens, 40):
        calls.append(functools.partial(flash_attn_with_kvcache, prompt_q, *prompt_caches, k=prompt_k, v=prompt_v,
                                       cache_seqlens=lengths_given))
    calls.append(functools.partial(flash_attn_with_kvcache, prompt_q, *prompt_caches, k=prompt_k, v=prompt_v,
                                   cache_seqlens=cache_seqlens, causal=True,
                                   alibi_slopes=torch.rand(2, 4, device=device)))
    angles = torch.rand(128, 16, device=device)
    for caches, block_table in (((cache_k, cache_v), None), ((pool_k, pool_v), table)):  # continuous batching
        calls.append(functools.partial(flash_attn_with_kvcache, packed_q[:12], *caches, cache_seqlens=cache_seqlens,
                                       block_table=block_table, cu_seqlens_q=chunk_cu, max_seqlen_q=9))
        calls.append(functools.partial(flash_attn_with_kvcache, packed_q[:12], *caches, packed_k[:12], packed_v[:12],
                                       angles.cos(), angles.sin(), cache_seqlens=cache_seqlens,
                                       block_table=block_table, cu_seqlens_q=chunk_cu, cu_seqlens_k_new=chunk_cu,
                                       max_seqlen_q=9))
    rows = torch.tensor([1, 0], dtype=torch.int32, device=device)
    leftpad = torch.tensor([2, 30], dtype=torch.int32, device=device)
    for lengths_given in (cache_seqlens, 40):
        calls.append(functools.partial(flash_attn_with_kvcache, step_q, cache_k, cache_v, step_k, step_v,
                                       angles.cos(), angles.sin(), cache_seqlens=lengths_given, cache_batch_idx=rows,
                                       cache_leftpad=leftpad))
    return calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
def test_entry_points_do_not_sync_the_host(triton_path):
    """No flash_attn_* call reads a device value on the host: under the sync debug mode any such read
    (.item(), .tolist(), a device-to-host copy, nonzero) raises. A first round of the same calls on
    other tensors compiles and autotunes (the autotuner synchronises) and fills the plan caches; the
    checked round's offsets are new tensors, so no per-tensor check cache can hide a read."""
    for call in _entry_point_calls("cuda"):
        call()
    calls = _entry_point_calls("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
