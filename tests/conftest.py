"""Test-session setup.

Without a GPU the Triton kernels run in Triton's interpreter, which must be switched on before
triton is first imported. The interpreter is slow, so the default path for the whole session is the
PyTorch one; tests of the Triton path ask for it with the ``triton_path`` fixture.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("FLASHFORMER_KERNEL", "torch")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def triton_path(monkeypatch):
    """Route flash_attn_* through the Triton kernels, with outputs NaN-poisoned before launch."""
    monkeypatch.setenv("FLASHFORMER_KERNEL", "triton")
    monkeypatch.setenv("FLASHFORMER_POISON", "1")
