"""Autoregressive sampling with a KV cache, and the ``flashformer generate`` command."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch

from .attention import ATTN_BACKENDS, cached_attention, resolve_backend


def _check_sampling_args(max_new_tokens, temperature, top_k, top_p):
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")


def sample_next_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row from logits (batch, vocab); greedy when temperature == 0.

    top_k keeps the k most likely tokens; top_p keeps the smallest set of most likely tokens whose
    probability reaches top_p (always at least one). Returns (batch,) int64.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, -float("inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens more likely than it already reach top_p.
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -float("inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


class _DeviceLengthCache:
    """A KVCache's buffers with its length kept on the device, one entry per row: a decoding step
    through it reads no host value (flash's CUDA-graph-safe path), so it can be captured once and
    replayed for every token. The model advances ``length`` in place after its layers ran."""

    def __init__(self, cache):
        self.keys, self.values = cache.keys, cache.values
        self.length = torch.full((cache.keys[0].shape[0],), cache.length, dtype=torch.int32,
                                 device=cache.keys[0].device)

    def attend(self, layer_idx, q, k, v, **attention_kwargs):
        """As KVCache.attend (``backend`` must be flash's: _check_cuda_graph checked it)."""
        return cached_attention(q, k, v, self.keys[layer_idx], self.values[layer_idx], self.length,
                                **attention_kwargs)


def _decode_step(model, tokens, cache):
    """Logits (batch, vocab) after appending ``tokens`` (batch, 1) to a _DeviceLengthCache."""
    return model(tokens, position_ids=cache.length[:, None].long(), kv_cache=cache)[:, -1]


class _GraphedDecodeStep:
    """One decoding step of ``model`` captured in a CUDA graph (embedding, every layer, the LM head):
    per token, Python launches one graph instead of every kernel of every layer."""

    def __init__(self, model, cache):
        self.cache = _DeviceLengthCache(cache)
        self.tokens = torch.zeros(cache.keys[0].shape[0], 1, dtype=torch.long, device=cache.keys[0].device)
        start = self.cache.length.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile the kernels and warm the allocator outside the capture
            for _ in range(2):
                _decode_step(model, self.tokens, self.cache)
        torch.cuda.current_stream().wait_stream(side)
        # The warm-up wrote at positions the real steps overwrite before any query can see them.
        self.cache.length.copy_(start)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = _decode_step(model, self.tokens, self.cache)

    def __call__(self, tokens):
        """Logits (batch, vocab) after ``tokens`` (batch,): a view that the next call overwrites."""
        self.tokens.copy_(tokens[:, None])
        self.graph.replay()
        return self.logits


def _check_cuda_graph(model, device):
    if device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs the model on a CUDA device, not {device}")
    if resolve_backend(model.attn_backend) != "flash":
        raise ValueError(f"cuda_graph=True needs attn_backend='flash', got {model.attn_backend!r}")
    if model.rope is not None and model.rope.is_dynamic:
        raise ValueError("cuda_graph=True cannot run dynamic-NTK RoPE: it reads the longest position on the host")


@torch.no_grad()
def generate(model, input_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None, stop_tokens=(), seed=None,
             stream=None, cuda_graph=False):
    """Extend ``input_ids`` token by token, reusing a KV cache.

    Args:
        model: a Transformer.
        input_ids: (batch, prompt_len) or (prompt_len,) int64 prompt, non-empty.
        max_new_tokens: most tokens to add.
        temperature: softmax temperature; 0 is greedy (argmax).
        top_k, top_p: restrict sampling to the k most likely tokens / the top_p probability nucleus.
        stop_tokens: ids that end a row (the stop token is kept). Generation ends when every row
            stopped; rows that stopped earlier are padded with their stop token.
        seed: seeds a private generator, so the same seed gives the same tokens.
        stream: called with each step's new tokens (batch,) as they are produced.
        cuda_graph: replay one CUDA graph per token instead of launching every kernel from Python
            (decoding one token is host-bound); CUDA, attn_backend="flash", non-dynamic RoPE only.
    Returns:
        (batch, prompt_len + generated) int64, generated <= max_new_tokens.
    """
    _check_sampling_args(max_new_tokens, temperature, top_k, top_p)
    device = model.embed.weight.device
    input_ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    batch, prompt_len = input_ids.shape
    if prompt_len == 0:
        raise ValueError("input_ids must hold at least one prompt token")
    total = prompt_len + max_new_tokens
    dynamic_rope = model.rope is not None and model.rope.is_dynamic  # made to stretch past max_seq_len
    if total > model.config.max_seq_len and not dynamic_rope:
        if model.config.pos == "learned":
            raise ValueError(f"prompt + max_new_tokens = {total} exceeds max_seq_len={model.config.max_seq_len}, the "
                             "positions this model has embeddings for: shorten the prompt or max_new_tokens")
        warnings.warn(f"generating {total} tokens past the {model.config.max_seq_len} this model was configured "
                      "for: RoPE positions beyond it were never trained (extend the context first, e.g. "
                      "flashformer finetune-long)", stacklevel=2)
    if cuda_graph:
        _check_cuda_graph(model, device)
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    stop = torch.tensor(list(stop_tokens), dtype=torch.long, device=device)
    cache = model.new_kv_cache(batch, total)
    logits = model(input_ids, kv_cache=cache)[:, -1]
    graphed_step = _GraphedDecodeStep(model, cache) if cuda_graph and max_new_tokens > 1 else None
    tokens = [input_ids]
    stopped_with = torch.full((batch,), -1, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        next_tokens = sample_next_token(logits, temperature, top_k, top_p, generator)
        next_tokens = torch.where(stopped_with >= 0, stopped_with, next_tokens)
        tokens.append(next_tokens[:, None])
        if stream is not None:
            stream(next_tokens)
        if step == max_new_tokens - 1:
            break
        if len(stop):  # asking the device whether every row stopped waits for it: only when a row can stop
            hit_stop = torch.isin(next_tokens, stop) & (stopped_with < 0)
            stopped_with = torch.where(hit_stop, next_tokens, stopped_with)
            if bool((stopped_with >= 0).all()):
                break
        if graphed_step is not None:
            logits = graphed_step(next_tokens)
        else:
            logits = model(next_tokens[:, None], kv_cache=cache)[:, -1]
    return torch.cat(tokens, dim=1)


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
