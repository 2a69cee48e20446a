"""flashformer: GPT-style models on our own Triton FlashAttention kernels."""


def from_pretrained(path, dtype=None, device=None, attn_backend="auto"):
    """Load a Transformer from a flashformer or Hugging Face checkpoint directory.

    Imported lazily so that ``import flashformer`` stays cheap; see checkpoint.from_pretrained.
    """
    from .checkpoint import from_pretrained as load

    return load(path, dtype=dtype, device=device, attn_backend=attn_backend)
