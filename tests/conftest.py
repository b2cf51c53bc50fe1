"""Test set-up shared by the whole suite.

On a machine without CUDA, Triton kernels run under the Triton interpreter
(``TRITON_INTERPRET=1`` must be set before triton is imported), so CI on CPU still
checks kernel logic at small sizes. Tests marked ``gpu`` need a real device and are
skipped without one.
"""

import os

import pytest

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # the planner tests need no torch
    HAS_CUDA = False

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
