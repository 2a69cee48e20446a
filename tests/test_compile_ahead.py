"""Compile-ahead (kernels/compile_ahead.py): the backward's kernels compiled in a background thread while
the forward runs, through launch.launcher's compile-only mode."""

import threading

import pytest
import torch
import triton
import triton.language as tl

from flashformer.kernels import compile_ahead, flash_attn_func, flash_bwd, launch, settings

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="compile-ahead compiles for a CUDA device")


@triton.jit
def _store_seven(OUT):
    tl.store(OUT, 7)


def _inputs(seqlen=1001, head_dim=128, heads=(4, 4), dtype=torch.bfloat16, window=(-1, 0), softcap=0.0,
            deterministic=True, varlen=False):
    """Forward arguments as interface._forward_impl takes them (tensors on the CPU: the key reads no data)."""
    tokens = (seqlen,) if varlen else (1, seqlen)
    q = torch.empty(*tokens, heads[0], head_dim, dtype=dtype)
    k = torch.empty(*tokens, heads[1], head_dim, dtype=dtype)
    cu_seqlens = torch.tensor([0, seqlen], dtype=torch.int32) if varlen else None
    max_seqlen = seqlen if varlen else 0
    return (q, k, k, cu_seqlens, cu_seqlens, None, None,
            max_seqlen, max_seqlen, head_dim ** -0.5, *window, softcap, 0.0, deterministic)


def test_the_launch_helper_launches_outside_compile_only(device):
    out = torch.zeros(1, dtype=torch.int32, device=device)
    launch.launcher(_store_seven, (1,))(out)
    assert out.item() == 7


def test_compile_only_refuses_the_autotuner_before_it_times_anything():
    with launch.compile_only(), pytest.raises(launch.WouldAutotune):
        launch.launcher(flash_bwd._bwd_dq_tuned, (1,))


def test_compile_ahead_is_off_in_the_interpreter_and_by_its_switch(monkeypatch):
    q = torch.empty(1, 16, 2, 64)
    if settings.INTERPRETED:
        assert not compile_ahead.wanted(q, q)
    monkeypatch.setenv("FLASHFORMER_COMPILE_AHEAD", "0")
    assert not settings.compile_ahead_enabled()
    assert not compile_ahead.wanted(q, q)


def test_the_key_separates_what_specialises_the_backward():
    base = compile_ahead.backward_key(_inputs(), gluon=True)
    # Lengths of one bucket and one divisibility class share their kernels.
    assert compile_ahead.backward_key(_inputs(seqlen=1003), gluon=True) == base
    different = [_inputs(dtype=torch.float16), _inputs(head_dim=64), _inputs(heads=(4, 2)), _inputs(window=(64, 0)),
                 _inputs(window=(-1, -1)), _inputs(softcap=30.0), _inputs(deterministic=False), _inputs(varlen=True),
                 _inputs(seqlen=3001), _inputs(seqlen=1008)]
    keys = [compile_ahead.backward_key(inputs, gluon=True) for inputs in different]
    keys.append(compile_ahead.backward_key(_inputs(), gluon=False))
    assert base not in keys and len(set(keys)) == len(keys)
    # deterministic=False past 2k keys takes the fused Gluon form, at 1.5k the two kernels: one bucket apart.
    assert (compile_ahead.backward_key(_inputs(seqlen=1500, deterministic=False), gluon=True)
            != compile_ahead.backward_key(_inputs(seqlen=2048 + 16 * 31, deterministic=False), gluon=True))


def test_the_key_kept_per_shape_is_the_key_formed_afresh():
    variants = [_inputs(), _inputs(seqlen=1003), _inputs(dtype=torch.float16), _inputs(head_dim=64),
                _inputs(heads=(4, 2)), _inputs(window=(64, 0)), _inputs(window=(-1, -1)), _inputs(softcap=30.0),
                _inputs(deterministic=False), _inputs(varlen=True), _inputs(seqlen=3001), _inputs(seqlen=1008),
                _inputs(seqlen=1500, deterministic=False), _inputs(seqlen=2048 + 16 * 31, deterministic=False)]
    for gluon in (True, False):
        for inputs in variants:
            assert compile_ahead.cached_backward_key(inputs, gluon) == compile_ahead.backward_key(inputs, gluon)
    # fresh tensors of the same shapes: the kept key, not a new one
    first = compile_ahead.cached_backward_key(_inputs(seqlen=777), True)
    assert compile_ahead.cached_backward_key(_inputs(seqlen=777), True) is first


def _gradients(seed, head_dim, heads, seqlen, window):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(2, seqlen, heads[i], head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
               .requires_grad_() for i in (0, 1, 1))
    grad_out = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    out = flash_attn_func(q, k, v, causal=True, window_size=window)
    return out, lambda: torch.autograd.grad(out, (q, k, v), grad_out)


@cuda_only
@pytest.mark.parametrize("head_dim", [64, 128])
def test_after_a_fresh_forward_the_backward_compiles_nothing_on_the_main_thread(head_dim, monkeypatch):
    compiles, phase = [], ["forward"]
    compile_missing = triton.runtime.jit.JITFunction._do_compile

    # Every compile passes here, in the thread that asks for it (Triton's jit_cache_hook would serialise
    # the Gluon kernels' layout constexprs to JSON, which they do not support).
    def record(kernel, *args, **kwargs):
        compiles.append((threading.current_thread().name, phase[0], kernel.fn.__name__))
        return compile_missing(kernel, *args, **kwargs)

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "_do_compile", record)
    shape = dict(head_dim=head_dim, heads=(6, 2), seqlen=777, window=(61, 0))  # a specialisation no other test has
    _, backward = _gradients(0, **shape)
    phase[0] = "backward"
    grads = backward()
    torch.cuda.synchronize()
    # The backward runs on autograd's device thread; compile-ahead's threads are named flashformer-*.
    on_backward_threads = [name for thread, when, name in compiles
                           if not thread.startswith("flashformer-") and when == "backward"]
    assert on_backward_threads == []
    monkeypatch.setenv("FLASHFORMER_COMPILE_AHEAD", "0")
    _, backward = _gradients(0, **shape)
    for ahead, alone in zip(grads, backward()):
        assert torch.equal(ahead, alone)


@cuda_only
def test_a_forward_whose_backward_never_runs_leaves_the_next_calls_intact(monkeypatch):
    out, _ = _gradients(1, head_dim=128, heads=(10, 2), seqlen=555, window=(-1, 0))
    del out, _
    _, backward = _gradients(2, head_dim=128, heads=(10, 5), seqlen=333, window=(-1, 0))
    grads = backward()
    _, backward_again = _gradients(1, head_dim=128, heads=(10, 2), seqlen=555, window=(-1, 0))
    grads_again = backward_again()
    monkeypatch.setenv("FLASHFORMER_COMPILE_AHEAD", "0")
    for seed, heads, seqlen, expected in ((2, (10, 5), 333, grads), (1, (10, 2), 555, grads_again)):
        _, backward = _gradients(seed, head_dim=128, heads=heads, seqlen=seqlen, window=(-1, 0))
        for got, want in zip(expected, backward()):
            assert torch.equal(got, want)


@cuda_only
def test_launchers_load_only_on_the_launching_threads(monkeypatch):
    """Every Triton launcher is a module named __triton_launcher, and two threads loading launchers at once can
    swap them (compile_ahead.py): the background job compiles, and no launcher loads on its threads."""
    loads = []
    init_handles = triton.compiler.compiler.CompiledKernel._init_handles

    def record(kernel):
        loads.append(threading.current_thread().name)
        return init_handles(kernel)

    monkeypatch.setattr(triton.compiler.compiler.CompiledKernel, "_init_handles", record)
    # head_dim 112: kernels no other test compiles (the Gluon kernels specialise on it, not on lengths), so this
    # process loads their launchers here
    _, backward = _gradients(3, head_dim=112, heads=(6, 3), seqlen=611, window=(-1, 0))
    backward()
    torch.cuda.synchronize()
    assert loads and not any(name.startswith("flashformer-") for name in loads), loads


def test_exit_cancels_queued_compiles_instead_of_running_them(tmp_path):
    """A process that queued backward compiles it never needed exits without running them."""
    import subprocess
    import sys
    ran = tmp_path / "ran.txt"
    script = f"""
import time
from flashformer.kernels import compile_ahead

def job(index):
    with open({str(ran)!r}, "a") as log:
        log.write(f"{{index}}\\n")
    time.sleep(1.0)

worker = compile_ahead._executor("compile-ahead", 1)
for index in range(10):
    worker.submit(job, index)
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    # the job running at exit finishes (and, were the main thread slow to exit, one more): never all ten
    assert 1 <= len(ran.read_text().split()) <= 2
