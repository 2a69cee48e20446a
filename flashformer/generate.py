"""The ``flashformer generate`` command, and ``generate``, the sampling loop as a function of the model
(``model.generate`` is the same loop as a method; both live in sampling.py, below the model)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from .attention import ATTN_BACKENDS
from .sampling import generate

__all__ = ["generate", "main"]


class _TextStream:
    """Writes the text of streamed token ids, holding back a cut multi-byte character."""

    def __init__(self, tokenizer, skip_ids, out):
        self.tokenizer, self.skip_ids, self.out = tokenizer, set(skip_ids), out
        self.ids, self.written = [], 0

    def __call__(self, new_tokens):
        token = int(new_tokens[0])
        if token in self.skip_ids:
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the rest of its bytes
        self.out.write(text[self.written:])
        self.out.flush()
        self.written = len(text)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """``flashformer generate CHECKPOINT --prompt ...``: stream a sampled continuation to stdout."""
    from .checkpoint import from_pretrained, resolve_checkpoint_dir
    from .tokenizer import TOKENIZER_FILE, ByteTokenizer, load_tokenizer
    from .weights import CheckpointError

    parser = argparse.ArgumentParser(prog="flashformer generate", description=main.__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("checkpoint", help="flashformer or Hugging Face checkpoint directory, a run directory "
                        "(its latest checkpoint), or a Hugging Face hub id org/name (from the Hugging Face cache)")
    parser.add_argument("--revision", default=None, help="a hub id's branch, tag or commit (default: main)")
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=200,
                        help="tokens to sample at most (stops early at an end-of-text token)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens only")
    parser.add_argument("--top-p", type=float, default=None, help="sample among the likeliest tokens whose "
                        "probabilities sum to p (nucleus sampling)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampler, for a repeatable sample")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model runs")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="weights' dtype (default: as stored)")
    parser.add_argument("--attn-backend", default="auto", choices=ATTN_BACKENDS,
                        help="attention implementation (auto is flash)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="replay one CUDA graph per token (CUDA and attn_backend=flash only)")
    args = parser.parse_args(argv)

    checkpoint = resolve_checkpoint_dir(args.checkpoint, args.revision)
    if checkpoint != args.checkpoint:
        what = "the latest checkpoint" if os.path.isdir(args.checkpoint) else "the Hugging Face cache's snapshot"
        print(f"{parser.prog}: {checkpoint} ({what} of {args.checkpoint})", file=sys.stderr)
    model = from_pretrained(checkpoint, dtype=args.dtype, device=args.device, attn_backend=args.attn_backend)
    tokenizer = load_tokenizer(checkpoint)
    if (not os.path.isfile(os.path.join(checkpoint, TOKENIZER_FILE))
            and model.config.vocab_size > ByteTokenizer().vocab_size):
        raise CheckpointError(f"{checkpoint} has no {TOKENIZER_FILE} for its {model.config.vocab_size}-token "
                              f"vocabulary (bytes would be a guess): copy the model's {TOKENIZER_FILE} there")
    eos_id = tokenizer.eos_id
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        if eos_id is None:
            parser.error("--prompt is empty and the tokenizer has no end-of-text token to start from")
        prompt_ids = [eos_id]
    stop_tokens = tuple(tokenizer.eos_ids)  # every end token generation_config.json lists (Llama 3 has several)
    sys.stdout.write(args.prompt)
    try:
        generate(model, torch.tensor([prompt_ids]), args.max_new_tokens, temperature=args.temperature,
                 top_k=args.top_k, top_p=args.top_p, stop_tokens=stop_tokens, seed=args.seed,
                 stream=_TextStream(tokenizer, stop_tokens, sys.stdout), cuda_graph=args.cuda_graph)
    except ValueError as error:  # the sampling options or the length: the user's to fix
        sys.stdout.write("\n")
        parser.error(str(error))
    sys.stdout.write("\n")
    return 0
