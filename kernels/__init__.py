"""flashformer.kernels: exact attention through our Triton FlashAttention kernels.

Knows nothing of models or training. See interface.py for the choice of path.
"""

from .flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                         flash_attn_varlen_backward, flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                         flash_attn_varlen_qkvpacked_func)
from .interface import force_kernel_impl, kernel_impl
from .kvcache import flash_attn_with_kvcache
from .packing import (cu_seqlens_from_document_ids, cu_seqlens_from_lengths, document_ids_from_cu_seqlens,
                      position_ids_from_cu_seqlens)
from .reference import attention_materialized

__all__ = [
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_backward",
    "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "force_kernel_impl", "kernel_impl",
    "attention_materialized", "cu_seqlens_from_document_ids", "cu_seqlens_from_lengths",
    "document_ids_from_cu_seqlens", "position_ids_from_cu_seqlens",
]
