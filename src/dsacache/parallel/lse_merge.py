"""Merging partial attention outputs by their log-sum-exp (LSE).

Rank ``r`` of a DCP group attends to the selected tokens it stores and returns, per query
head, ``out_r = sum_j p_j v_j / sum_j p_j`` over its tokens and ``lse_r = log sum_j p_j``
(``p_j = exp(score_j)``). Over all ranks::

    lse = log sum_r exp(lse_r)
    out = sum_r exp(lse_r - lse) * out_r

which is the attention over the union of the tokens, exactly (up to rounding). A rank that
attended to no token has ``lse_r = -inf`` and weight 0; a head no rank attended for keeps
``out = 0``, ``lse = -inf``, the sparse MLA decode's convention for an empty row. The sums
run in fp32. Fixed-shape device work, no host sync.
"""

from __future__ import annotations

import torch


def merged_lse(lse_parts: torch.Tensor) -> torch.Tensor:
    """``[N, *rows]`` fp32 partial LSEs -> ``[*rows]`` fp32 ``log sum_r exp(lse_r)`` (``-inf`` if all are)."""
    return torch.logsumexp(lse_parts.float(), dim=0)


def partial_weights(lse_parts: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(lse_parts - lse)`` fp32, 0 for a ``-inf`` part (and for every part of a ``-inf`` row).

    ``lse_parts`` is ``[N, *rows]`` (or ``[*rows]`` for one part), ``lse`` ``[*rows]``.
    """
    return torch.exp(lse_parts.float() - torch.where(torch.isfinite(lse), lse, 0.0))


def merge_partials(out_parts: torch.Tensor, lse_parts: torch.Tensor, out: torch.Tensor | None = None,
                   lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention output of each row from ``N`` partial outputs over disjoint token sets.

    Args:
        out_parts: ``[N, *rows, D]`` (bf16 or fp32) partial outputs.
        lse_parts: ``[N, *rows]`` fp32 partial LSEs (natural log, ``-inf`` = no token).
        out: optional ``[*rows, D]`` buffer (its dtype is the result's; bf16 by default).
        lse: optional ``[*rows]`` fp32 buffer.

    Returns:
        ``(out, lse)``: ``out [*rows, D]``, ``lse [*rows]`` fp32.

    >>> parts = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])       # two ranks, one row, D = 2
    >>> o, s = merge_partials(parts, torch.tensor([[0.0], [0.0]]))
    >>> o.float().tolist(), round(float(s[0]), 4)
    ([[0.5, 0.5]], 0.6931)
    """
    total = merged_lse(lse_parts)
    weights = partial_weights(lse_parts, total)
    merged = (out_parts.float() * weights[..., None]).sum(dim=0)
    out = merged.to(torch.bfloat16) if out is None else out.copy_(merged)
    lse = total if lse is None else lse.copy_(total)
    return out, lse


def weighted_partial(out_part: torch.Tensor, lse_part: torch.Tensor, lse: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """One rank's share of the merged output, ``exp(lse_part - lse) * out_part``; the shares of all
    ranks sum to the merged output (what a reduce-scatter adds up).

    Args:
        out_part: ``[*rows, D]`` partial output; ``lse_part`` ``[*rows]`` its LSE; ``lse``
            ``[*rows]`` the merged LSE (:func:`merged_lse` over every rank's parts).
        out: optional ``[*rows, D]`` buffer (bf16 by default).
    """
    share = out_part.float() * partial_weights(lse_part, lse)[..., None]
    return share.to(torch.bfloat16) if out is None else out.copy_(share)
