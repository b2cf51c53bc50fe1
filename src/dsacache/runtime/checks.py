"""Argument checks shared by the runtime's public functions: a bad type or value is a
``ValueError`` naming the argument, raised before anything changes.

Integers are Python ints and NumPy integers (anything registered as
``numbers.Integral``); ``bool`` is refused although Python counts it as an int, and so
are floats, even whole ones (``2.0``).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch


def is_int(value: object) -> bool:
    """An integer in the sense above."""
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def int_arg(value: object, name: str, minimum: int = 0) -> int:
    """``value`` as a Python int; ``ValueError`` unless it is an integer ``>= minimum``."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def optional_int_arg(value: object, name: str, minimum: int = 0) -> int | None:
    """Like :func:`int_arg`, with ``None`` allowed (and returned)."""
    return None if value is None else int_arg(value, f"{name} (or None)", minimum)


def int_list(values: object, name: str, minimum: int = 0) -> list[int]:
    """A sequence of integers ``>= minimum`` as a list of Python ints (host lengths)."""
    if isinstance(values, (str, bytes)) or (not isinstance(values, Sequence) and not hasattr(values, "tolist")):
        raise ValueError(f"{name} must be a sequence of integers, got {type(values).__name__}")
    items = values.tolist() if hasattr(values, "tolist") else list(values)
    for i, value in enumerate(items):
        if not is_int(value) or value < minimum:
            raise ValueError(f"{name}[{i}] must be an integer >= {minimum}, got {value!r}")
    return [int(v) for v in items]


def device_arg(device: object, name: str = "device") -> torch.device:
    """``device`` as a ``torch.device``; ``ValueError`` naming ``name`` for anything torch cannot parse."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name} must be a torch device or its name ('cpu', 'cuda', 'cuda:1'), got {device!r}") \
            from None


def describe(value: object) -> str:
    """A tensor's dtype and shape, or another value's type name (for error messages)."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__


def tensor_arg(value: object, name: str, dtype: torch.dtype, dim: int, what: str, contiguous: bool = False) -> None:
    """``ValueError`` ("``name`` must be ``what``, got ...") unless ``value`` is a ``dim``-D ``dtype`` tensor
    (and contiguous when asked)."""
    if (not isinstance(value, torch.Tensor) or value.dim() != dim or value.dtype != dtype
            or contiguous and not value.is_contiguous()):
        raise ValueError(f"{name} must be {what}, got {describe(value)}")
