"""Tolerance helpers shared by kernel tests."""

import torch


def rel_rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` over finite reference entries, in float64."""
    out, ref = out.double(), ref.double()
    mask = torch.isfinite(ref)
    num = (out[mask] - ref[mask]).norm()
    den = ref[mask].norm().clamp_min(1e-30)
    return float(num / den)


def calc_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``1 - 2<x, y> / (<x, x> + <y, y>)`` over finite reference entries (DeepGEMM-style)."""
    out, ref = out.double(), ref.double()
    mask = torch.isfinite(ref)
    x, y = out[mask], ref[mask]
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
