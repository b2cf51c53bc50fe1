"""Which implementation runs: the Triton kernel or the PyTorch reference.

One rule for every public function of ``dsacache.ops`` and ``dsacache.runtime``:
``impl="auto"`` runs Triton when every tensor is on CUDA and PyTorch otherwise;
``"triton"`` forces the kernel (on CPU tensors it needs ``TRITON_INTERPRET=1``);
``"torch"`` forces the reference. Nothing falls back silently: a forced choice that
cannot run raises.
"""

from __future__ import annotations

import os

import torch

IMPLS = ("auto", "triton", "torch")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the tensors unless they all live on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (``TRITON_INTERPRET`` set to 1, true or on,
    the values Triton itself accepts; it reads the variable when ``triton`` is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


def use_triton(impl: str, *tensors: torch.Tensor) -> bool:
    """True when the Triton path should run for ``tensors`` under ``impl``."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; allowed: {', '.join(IMPLS)}")
    if impl == "torch":
        return False
    if impl == "auto" and not all(t.is_cuda for t in tensors):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        if impl == "triton":
            raise
        return False
    if not all(t.is_cuda for t in tensors) and not interpreting():
        # Only a forced "triton" gets here: compiled kernels cannot read host memory.
        raise ValueError("impl='triton' with CPU tensors needs the Triton interpreter (TRITON_INTERPRET=1 "
                         "before triton is imported); use impl='auto' or 'torch', or CUDA tensors")
    return True
