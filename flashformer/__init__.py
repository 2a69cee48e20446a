"""flashformer: GPT-style models on our own Triton FlashAttention kernels."""
