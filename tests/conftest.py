"""Shared fixtures. On a machine without CUDA the Triton kernels run in the interpreter
(TRITON_INTERPRET=1 must be set before triton decorates them, hence here, first)."""

import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The card's own line resolves this checkout instead of the Hub, offline.
os.environ["LOCAL_KERNELS"] = f"qgallouedec/fused-linear-ce={ROOT}"

import pytest  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(scope="session")
def flce():
    """The kernel as users load it: ``get_kernel`` with the card's arguments."""
    from kernels import get_kernel

    return get_kernel("qgallouedec/fused-linear-ce", version=1, trust_remote_code=True)


@pytest.fixture
def device():
    return DEVICE
