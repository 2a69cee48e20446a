"""Decoding speed end to end: tokens/s of ``generate`` eagerly and with one CUDA graph per token.

A randomly initialised model of a config in configs/models/ (speed does not depend on the weights),
bf16, greedy, batch B, a prompt of P tokens, N new tokens. The table also gives the share of tokens equal
to ours eagerly: the graph sizes its cache splits for the whole cache and SDPA sums in its own order, so
a bf16 near-tie can flip a greedy token and the rest of that row. Paths: ours eagerly (attn_backend=flash: every kernel launched from Python, the host-bound case), ours
with ``cuda_graph=True`` (each generate call captures its graph; the capture is in the time, as a user
pays it), and SDPA eagerly (attn_backend=sdpa, torch's choice of backend). tokens/s counts the new
tokens of every row over the whole call, prefill included.

    python scripts/bench_generate.py configs/models/llama-125m.yaml --batches 1 8 --prompt 512 --new 256
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm

from flashformer.config import load_config
from flashformer.generate import generate
from flashformer.model import ModelConfig, Transformer
from flashformer.profiling import benchmark_provenance

PATHS = {"ours eager": ("flash", False), "ours CUDA graph": ("flash", True), "SDPA eager": ("sdpa", False)}


def time_generate(model, prompt, new_tokens, cuda_graph, repeats=3):
    """(median seconds of one generate call, its tokens), after one untimed call."""
    out = generate(model, prompt, new_tokens, temperature=0, cuda_graph=cuda_graph)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate(model, prompt, new_tokens, temperature=0, cuda_graph=cuda_graph)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_config", help="e.g. configs/models/llama-125m.yaml")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per row")
    parser.add_argument("--new", type=int, default=256, help="generated tokens per row")
    parser.add_argument("--out", default="bench_generate.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_generate.py needs a CUDA device")
    config = load_config(ModelConfig, args.model_config)
    torch.manual_seed(0)
    model = Transformer(config).to("cuda", torch.bfloat16).eval()
    rows = []
    for batch in tqdm(args.batches, desc="batches"):
        prompt = torch.randint(0, config.vocab_size, (batch, args.prompt), device="cuda")
        row, reference = {"batch": batch}, None
        for name, (backend, cuda_graph) in PATHS.items():
            model.attn_backend = backend
            seconds, tokens = time_generate(model, prompt, args.new, cuda_graph)
            row[name] = batch * args.new / seconds
            # bf16 logits can tie differently between attention implementations: count agreement.
            reference = tokens if reference is None else reference
            row[f"{name} same tokens"] = (tokens == reference).float().mean().item()
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({**benchmark_provenance(), "model": args.model_config, "prompt": args.prompt,
                   "new": args.new, "rows": rows}, f, indent=1)
    print(f"| batch | {' | '.join(f'{name} tokens/s' for name in PATHS)} | graph / eager | tokens equal to eager |")
    print("|" + "---|" * (len(PATHS) + 3))
    for row in rows:
        print(f"| {row['batch']} | " + " | ".join(f"{row[name]:.0f}" for name in PATHS)
              + f" | {row['ours CUDA graph'] / row['ours eager']:.2f}"
              + f" | graph {row['ours CUDA graph same tokens']:.2f}, SDPA {row['SDPA eager same tokens']:.2f} |")


if __name__ == "__main__":
    main()
