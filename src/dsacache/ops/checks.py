"""Argument checks shared by the ops' public functions: one wording for each kind of mistake.

Every check raises ``ValueError`` naming the argument, before anything is launched or written.
"""

from __future__ import annotations

import numbers

import torch

from dsacache.formats.sizes import KERNEL_PAGE_SIZE

INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, value: object) -> None:
    """``value`` is a ``torch.Tensor``."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` is an integer (not a bool) ``>= minimum``; returned as an ``int``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_flag(name: str, value: object) -> None:
    """``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_slot_mapping(slot_mapping: object, num_tokens: int, num_pages: int, check_slots: object) -> None:
    """A step's ``slot_mapping``: 1-D int32/int64, one contiguous entry a token.

    With ``check_slots`` every value is read on the host (one device sync) and must be ``-1``
    or a slot of the ``num_pages`` pages; without it (CUDA-graph capture) the kernels skip
    out-of-range slots instead of writing them.
    """
    check_tensor("slot_mapping", slot_mapping)
    check_flag("check_slots", check_slots)
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"slot_mapping must be 1-D int32 or int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if slot_mapping.stride(0) != 1 and num_tokens > 1:
        raise ValueError("slot_mapping must be contiguous")
    if not check_slots or num_tokens == 0:
        return
    low, high = (int(v) for v in torch.aminmax(slot_mapping))
    num_slots = num_pages * KERNEL_PAGE_SIZE
    if low < -1 or high >= num_slots:
        raise ValueError(
            f"slot_mapping values must be -1 (skip) or in [0, {num_slots}) for {num_pages} pages; "
            f"got min {low}, max {high}"
        )
