"""flashformer: GPT-style models on our own Triton FlashAttention kernels."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flashformer")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"


def from_pretrained(path, dtype=None, device=None, attn_backend="auto", revision=None):
    """Load a Transformer from a flashformer or Hugging Face checkpoint directory, or a hub id ("org/name")
    from the Hugging Face cache.

    Imported lazily so that ``import flashformer`` stays cheap; see checkpoint.from_pretrained.
    """
    from .checkpoint import from_pretrained as load

    return load(path, dtype=dtype, device=device, attn_backend=attn_backend, revision=revision)
