"""Autoregressive sampling with a KV cache: the loop behind ``Transformer.generate`` and
``flashformer.generate.generate``.

It needs only what a model object offers (its forward with a KV cache, ``new_kv_cache``, config, rope),
so it sits below the model, which calls it.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

from .attention import cached_attention, resolve_backend


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
    if model.rope is not None and model.rope.reads_positions:
        raise ValueError("cuda_graph=True cannot run dynamic-NTK or LongRoPE RoPE: they read the longest position "
                         "on the host")


def token_ids(ids, name: str) -> tuple[int, ...]:
    """``ids`` (None, one int, or an iterable of ints: transformers' forms of eos_token_id) as a tuple.

    Raises:
        ValueError: naming the argument ``name`` when an id is not an int >= 0.
    """
    if ids is None:
        return ()
    try:
        ids = (ids,) if isinstance(ids, int) else tuple(ids)
    except TypeError:
        raise ValueError(f"{name} must be a token id or a sequence of them, got {ids!r}") from None
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{name} must hold token ids (ints >= 0), got {ids!r}")
    return ids


def _caller_stacklevel() -> int:
    """The warnings stacklevel of the first frame outside this package: the user's call, whether it came
    through model.generate, flashformer.generate.generate or the trainer."""
    package_dir = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package_dir):
        frame, level = frame.f_back, level + 1
    return level


def generate(model, input_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None, stop_tokens=(), seed=None,
             stream=None, cuda_graph=False):
    """Extend ``input_ids`` token by token, reusing a KV cache (under torch.no_grad).

    Args:
        model: a Transformer.
        input_ids: (batch, prompt_len) or (prompt_len,) int64 prompt, non-empty.
        max_new_tokens: most tokens to add. Past the model's max_seq_len a RoPE model warns (positions it
            never trained on) and a model with learned positions refuses (it has no embedding for them).
        temperature: softmax temperature; 0 is greedy (argmax).
        top_k, top_p: restrict sampling to the k most likely tokens / the top_p probability nucleus.
        stop_tokens: an id or ids that end a row (the stop token is kept). Generation ends when every row
            stopped; rows that stopped earlier are padded with their stop token.
        seed: seeds a private generator, so the same seed gives the same tokens.
        stream: called with each step's new tokens (batch,) as they are produced.
        cuda_graph: replay one CUDA graph per token instead of launching every kernel from Python
            (decoding one token is host-bound); CUDA, attn_backend="flash", non-dynamic RoPE only.
    Returns:
        (batch, prompt_len + generated) int64, the prompt first, generated <= max_new_tokens.
    """
    _check_sampling_args(max_new_tokens, temperature, top_k, top_p)
    stop_tokens = token_ids(stop_tokens, "stop_tokens")
    device = model.embed.weight.device
    input_ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, prompt_len) or (prompt_len,) with at least one prompt token, "
                         f"got shape {tuple(input_ids.shape)}")
    total = input_ids.shape[1] + max_new_tokens
    dynamic_rope = model.rope is not None and model.rope.is_dynamic  # made to stretch past max_seq_len
    if total > model.config.max_seq_len and not dynamic_rope:
        if model.config.pos == "learned":
            raise ValueError(f"prompt + max_new_tokens = {total} exceeds max_seq_len={model.config.max_seq_len}, the "
                             "positions this model has embeddings for: shorten the prompt or max_new_tokens")
        warnings.warn(f"generating {total} tokens past the {model.config.max_seq_len} this model was configured "
                      "for: RoPE positions beyond it were never trained (extend the context first, e.g. "
                      "flashformer finetune-long)", stacklevel=_caller_stacklevel())
    if cuda_graph:
        _check_cuda_graph(model, device)
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    stop = torch.tensor(stop_tokens, dtype=torch.long, device=device)
    return _sample_loop(model, input_ids, max_new_tokens, temperature, top_k, top_p, stop, generator, stream,
                        cuda_graph)


@torch.no_grad()
def _sample_loop(model, input_ids, max_new_tokens, temperature, top_k, top_p, stop, generator, stream, cuda_graph):
    """generate's loop over checked arguments; ``stop`` is a (n_stop,) int64 tensor on the model's device."""
    batch, total = input_ids.shape[0], input_ids.shape[1] + max_new_tokens
    cache = model.new_kv_cache(batch, total)
    logits = model(input_ids, kv_cache=cache)[:, -1]
    graphed_step = _GraphedDecodeStep(model, cache) if cuda_graph and max_new_tokens > 1 else None
    tokens = [input_ids]
    stopped_with = torch.full((batch,), -1, dtype=torch.long, device=input_ids.device)
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
        elif _at_longrope_switch(model, cache):
            cache = model.new_kv_cache(batch, total)
            logits = model(torch.cat(tokens, dim=1), kv_cache=cache)[:, -1]
        else:
            logits = model(next_tokens[:, None], kv_cache=cache)[:, -1]
    return torch.cat(tokens, dim=1)


def _at_longrope_switch(model, cache) -> bool:
    """Whether the next token is the first past LongRoPE's original context. From there its long factors
    rotate every position, so the cached keys (short factors) are rebuilt from the whole sequence, as
    transformers' Phi-3 generation does."""
    return model.rope is not None and model.rope.long_from is not None and cache.length == model.rope.long_from
