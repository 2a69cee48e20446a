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


def load_tokenizer(path, revision=None):
    """The tokenizer that goes with ``from_pretrained(path)``: the checkpoint's tokenizer.json (with its
    tokenizer_config.json and generation_config.json), or bytes for a checkpoint without one.

    Args:
        path, revision: as in from_pretrained: a checkpoint directory, a run directory (its latest
            checkpoint), or a hub id ("org/name") and its branch, tag or commit.
    """
    from .checkpoint import resolve_checkpoint_dir
    from .tokenizer import load_tokenizer as load

    return load(resolve_checkpoint_dir(path, revision))
