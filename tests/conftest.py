"""Test set-up shared by the whole suite.

On a machine without CUDA, Triton kernels run under the Triton interpreter
(``TRITON_INTERPRET=1`` must be set before triton is imported), so CI on CPU still
checks kernel logic at small sizes. Tests marked ``gpu`` need a real device and are
skipped without one. Tests marked ``interpret`` run Triton kernels on CPU tensors: on a
CUDA machine they are skipped unless the interpreter is on (their ``gpu`` twins run the
same kernels there).
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


def _interpreting() -> bool:
    # Same rule as dsacache.dispatch.interpreting (kept here: the planner tests need no torch).
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        if not _interpreting():
            skip = pytest.mark.skip(reason="Triton on CPU tensors needs TRITON_INTERPRET=1; the gpu tests run "
                                           "this kernel on the device")
            for item in items:
                if "interpret" in item.keywords:
                    item.add_marker(skip)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
