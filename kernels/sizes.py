"""The head sizes the kernels accept, how the launchers pad them, and host-side size arithmetic.

Imports nothing (not even Triton): interface.py checks arguments against these bounds on the PyTorch
path too.
"""

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# Tensor descriptors need 16-byte strides: 8 elements of a 16-bit dtype.
HEAD_DIM_MULTIPLE = 8
# A padded head_dim above this is "wide": its tiles do not fit the shared memory the narrower shapes
# assume (tuning.py's _WIDE_SHAPES and default configs).
WIDE_HEAD_DIM = 128


def cdiv(a, b):
    """ceil(a / b) for host code: triton.cdiv is a constexpr function, ~2 µs per call from Python, and a
    launch makes several such calls."""
    return -(-a // b)


def next_power_of_2(n):
    """The smallest power of two >= n (1 for n <= 1), for host code (see cdiv)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def pad_head_dim(head_dim):
    """HEAD_DIM_PAD: the power of two at or above ``head_dim``, at least MIN_HEAD_DIM (tl.dot's
    smallest K); tensor descriptors zero-fill the columns in between."""
    return max(MIN_HEAD_DIM, next_power_of_2(head_dim))
