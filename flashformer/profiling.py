"""Where time goes: per-kernel times of a repeated step (torch.profiler), host time per call (queued behind a GPU
sleep), the provenance every benchmark's JSON carries and its command-line checks (benchmarks only)."""

from __future__ import annotations

import cProfile
import datetime
import os
import pstats
import subprocess
import sys
import time

import torch


def check_specs(parser, specs, parse):
    """Stop through ``parser.error`` at the first of ``specs`` that ``parse`` refuses (its ValueError names
    it), before a benchmark starts any work."""
    for spec in specs:
        try:
            parse(spec)
        except ValueError as err:
            parser.error(str(err))


def benchmark_provenance() -> dict:
    """What a benchmark's JSON must say to be reproduced: the command, the UTC date, the commit (with
    "+dirty" for uncommitted changes) of the checkout flashformer is imported from, wherever the script runs
    from, the device and the torch / triton versions."""
    import triton

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):
        try:
            return subprocess.run(["git", "-C", checkout, *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"command": " ".join(["python3", *sys.argv]), "date": datetime.datetime.now(datetime.timezone.utc)
            .strftime("%Y-%m-%d %H:%M UTC"), "commit": commit, "device": device, "torch": torch.__version__,
            "triton": triton.__version__}


def kernel_times(step, iters, device="cuda"):
    """({kernel name: ms per call of ``step``}, wall ms per call), from ``iters`` traced calls.

    Only device-side events count (a CPU op also carries its kernels' time). ``device="cpu"`` traces
    CPU ops instead, for machines without a GPU.

    Args:
        step: a callable run ``iters`` times under the profiler (warm it up first).
        iters: calls to trace; times are their mean.
    """
    cuda = device == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        start = time.perf_counter()
        for _ in range(iters):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / iters
    wanted = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    times: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == wanted:
            own_us = event.device_time_total if cuda else event.self_cpu_time_total
            times[event.name] = times.get(event.name, 0.0) + own_us / 1e3 / iters
    return times, wall_ms


# Calls per round of host timing: x ~10 launches a forward + backward, far below the ~1024 launches a CUDA
# queue holds (a full queue would hold the host to the device's pace).
HOST_CALLS = 20
HOST_ROUNDS = 7
# ~0.1 s of GPU sleep (at ~2 GHz) before each round: longer than any round's host time
SLEEP_CYCLES = 2 * 10**8


def queued_behind_sleep(fn, calls=HOST_CALLS):
    """Host seconds to run ``fn`` ``calls`` times while the GPU sleeps, so that none of them runs before the
    host has queued them all (a call's host time, whatever its device time)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    slept = torch.cuda.Event()
    slept.record()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    if slept.query():  # the device went on to the calls before the host finished queueing them
        raise RuntimeError(f"SLEEP_CYCLES ({SLEEP_CYCLES}) ran out within a round: raise it")
    return seconds


def host_ms_per_call(fn):
    """Median host ms per call of ``fn`` over HOST_ROUNDS rounds of HOST_CALLS calls queued behind a GPU sleep
    (warm ``fn`` up first: compiles and autotuning are no host time per call)."""
    rounds = [queued_behind_sleep(fn) * 1e3 / HOST_CALLS for _ in range(HOST_ROUNDS)]
    torch.cuda.synchronize()
    return sorted(rounds)[len(rounds) // 2]


def host_profile(fn, top):
    """The ``top`` functions of most own host time in ``fn`` (cProfile over HOST_ROUNDS rounds of HOST_CALLS
    calls, queued behind a GPU sleep), as [name, calls per fn call, own ms per fn call, cumulative ms per fn call]."""
    profiler = cProfile.Profile()
    for _ in range(HOST_ROUNDS):
        profiler.runcall(queued_behind_sleep, fn, HOST_CALLS)
    torch.cuda.synchronize()
    return top_functions(profiler, HOST_ROUNDS * HOST_CALLS, top)


def top_functions(profiler, calls, top):
    """The ``top`` functions of most own time in a cProfile run over ``calls`` calls, per call."""
    rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][2])[:top]
    return [[f"{os.path.basename(file)}:{line}({name})", round(n_calls / calls, 2), round(own * 1e3 / calls, 4),
             round(cumulative * 1e3 / calls, 4)] for (file, line, name), (_, n_calls, own, cumulative, _) in rows]


def capture_cuda_graph(fn, warmups=1):
    """(graph, output): one ``fn()`` call captured in a CUDA graph, after ``warmups`` calls on a side
    stream (compilation and allocator warm-up stay outside the capture, as torch's docs prescribe).
    Replaying the graph reruns the captured kernels into the same output tensors: device time alone."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
