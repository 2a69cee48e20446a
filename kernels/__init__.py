"""flashformer.kernels: exact attention through our Triton FlashAttention kernels.

Knows nothing of models or training. See interface.py for the choice of path.

This directory installs as flashformer.kernels. Imported by the bare name ``kernels``, as it is wherever the
repository root is on sys.path (a REPL, ``python -c`` or ``python -m pytest`` there), it would shadow the PyPI
package of that name, Hugging Face's hub kernels, which transformers imports: it hands the name over to that
package instead and defines nothing itself.
"""


def _hand_the_name_to_the_shadowed_package():
    import importlib.machinery
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(__name__, elsewhere)
    if spec is None:
        return
    # The import system returns whatever sys.modules holds under the name once this module has run.
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_the_name_to_the_shadowed_package()
else:
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
