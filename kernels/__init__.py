"""flashformer.kernels: exact attention through our Triton FlashAttention kernels.

Knows nothing of models or training. See interface.py for the choice of path.
"""

from .interface import flash_attn_func, kernel_impl
from .reference import attention_materialized

__all__ = ["flash_attn_func", "kernel_impl", "attention_materialized"]
