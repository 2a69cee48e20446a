"""What flash_attn_with_kvcache does before attention, timed: the rotary append's device and host time
(cache_append's rows_kernel against PyTorch's form, with their largest difference), and the host time of a
decoding step at batch 1 (int lengths, tensor lengths with a one-token append, the same with rotary, the packed
form).

    python3 scripts/bench_cache_append.py --out bench_cache_append.json
    python3 scripts/with_tree.py run .gpu/trees/<commit> scripts/bench_cache_append.py   # an older version

Device µs: the kernels' own time per call under the profiler (flashformer.profiling.kernel_times), which a
host-bound call cannot inflate. Host µs: flashformer.profiling.host_ms_per_call (calls queued behind a GPU sleep).
Prints a markdown table last (CUDA only).
"""

from __future__ import annotations

import argparse
import json

import torch

from flashformer.kernels import flash_attn_with_kvcache
from flashformer.kernels.cache_append import Rotary, rotate_and_append, rotate_and_append_reference
from flashformer.profiling import benchmark_provenance, host_ms_per_call, kernel_times

HEADS_Q, HEADS_KV, HEAD_DIM, CAPACITY, DTYPE = 32, 8, 128, 4096, torch.bfloat16
# (batch, new tokens per sequence): a 2k-token prompt chunk, decoding steps at batch 8 and 64.
APPEND_SHAPES = [(1, 2048), (8, 1), (64, 1)]
PROFILED_CALLS = 50


def device_and_host_us(call):
    """(device µs, host µs) per call: the sum of its kernels' times, and its host time."""
    call()
    device_ms = sum(kernel_times(call, PROFILED_CALLS)[0].values())
    return round(device_ms * 1e3, 1), round(host_ms_per_call(call) * 1e3, 1)


def rotary_append_rows():
    """Device µs of the rotary append (q turned, k turned and appended with v) per shape and layout."""
    rows = []
    for batch, new in APPEND_SHAPES:
        k_cache, v_cache = (torch.randn(batch, CAPACITY, HEADS_KV, HEAD_DIM, device="cuda", dtype=DTYPE)
                            for _ in range(2))
        q = torch.randn(batch, new, HEADS_Q, HEAD_DIM, device="cuda", dtype=DTYPE)
        k, v = (torch.randn(batch, new, HEADS_KV, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
        lengths = torch.randint(0, CAPACITY - new, (batch,), dtype=torch.int32, device="cuda")
        angles = torch.rand(CAPACITY + new, HEAD_DIM // 2, device="cuda") * 6.3
        for layout in ("halves", "interleaved"):
            rotary = Rotary(angles.cos(), angles.sin(), layout == "interleaved", True)
            caches = [c.clone() for c in (k_cache, v_cache)]
            ours = rotate_and_append(q, *caches, k, v, lengths, None, None, rotary, triton_path=True)
            expected = rotate_and_append_reference(q, k_cache, v_cache, k, v, lengths, None, None, rotary)
            diff = max((a.float() - b.float()).abs().max().item()
                       for a, b in zip((ours, *caches), (expected, k_cache, v_cache)))
            kernel_us, kernel_host_us = device_and_host_us(lambda: rotate_and_append(
                q, k_cache, v_cache, k, v, lengths, None, None, rotary, triton_path=True))
            torch_us, torch_host_us = device_and_host_us(lambda: rotate_and_append_reference(
                q, k_cache, v_cache, k, v, lengths, None, None, rotary))
            rows.append(dict(batch=batch, new_tokens=new, layout=layout, kernel_us=kernel_us,
                             kernel_host_us=kernel_host_us, pytorch_us=torch_us, pytorch_host_us=torch_host_us,
                             max_diff=diff))
    return rows


def decode_step_host_rows():
    """Host µs per flash_attn_with_kvcache call at batch 1, cache CAPACITY, in the forms a server calls."""
    q = torch.randn(1, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=DTYPE)
    k_cache, v_cache = (torch.randn(1, CAPACITY, HEADS_KV, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    k, v = (torch.randn(1, 1, HEADS_KV, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    before = torch.full((1,), CAPACITY - 1, dtype=torch.int32, device="cuda")
    angles = torch.rand(CAPACITY, HEAD_DIM // 2, device="cuda")
    cos, sin = angles.cos(), angles.sin()
    one_each = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    calls = {
        "int cache_seqlens, no append": lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=CAPACITY,
                                                                          causal=True),
        "tensor cache_seqlens, one token appended": lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=before, causal=True),
        "tensor cache_seqlens, appended with rotary": lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=before, causal=True),
        "packed (cu_seqlens_q), one token appended": lambda: flash_attn_with_kvcache(
            q[0], k_cache, v_cache, k[0], v[0], cache_seqlens=before, cu_seqlens_q=one_each,
            cu_seqlens_k_new=one_each, max_seqlen_q=1, causal=True),
    }
    rows = []
    for name, call in calls.items():
        call()
        rows.append(dict(call=name, host_us=round(host_ms_per_call(call) * 1e3, 1)))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_cache_append.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cache_append.py times CUDA kernels: no CUDA device here")
    with torch.inference_mode():
        append, host = rotary_append_rows(), decode_step_host_rows()
    with open(args.out, "w") as f:
        json.dump(dict(provenance=benchmark_provenance(), rotary_append=append, decode_step_host=host), f, indent=1)
    print("| batch | new | rotary | kernel device / host µs | PyTorch device / host µs | device ratio | max diff |")
    print("|---|---|---|---|---|---|---|")
    for r in append:
        print(f"| {r['batch']} | {r['new_tokens']} | {r['layout']} | {r['kernel_us']} / {r['kernel_host_us']} | "
              f"{r['pytorch_us']} / {r['pytorch_host_us']} | {r['kernel_us'] / r['pytorch_us']:.2f} | "
              f"{r['max_diff']:.1e} |")
    print("| decoding step, batch 1 | host µs |\n|---|---|")
    for r in host:
        print(f"| {r['call']} | {r['host_us']} |")


if __name__ == "__main__":
    main()
