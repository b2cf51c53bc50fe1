"""KDA step metadata: each request's state indices, built once per scheduler step, read by every KDA layer.

A request owns ``G = state_rows_per_request`` state rows; KDA layer ``L`` sits in its state row
``g = pool.kda_state_row_index(L)``, at the same offset of every request's row, so the
layer's state views (:meth:`CachePool.kda_state_views`) are indexed by row ``g`` of
:attr:`KdaStepMetadata.state_indices`. The batch holds the decodes first (``next_n`` tokens
each), then the prefills, as in the indexer metadata. A padded batch entry (``None`` rows) gets
``-1``, which the ops skip and which fla-core's kernel sends to the pool's guard row.

Speculative decode keeps one recurrent state per token of the step (fla-core's rule: the
state after token ``i`` goes to that token's row, the next step starts from the row of its
last accepted token), so each decode request gives ``next_n`` row sets (``spec_state_rows``),
the first being its own state rows; the conv state uses the first set only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsacache.runtime.checks import device_arg, int_arg, int_list


@dataclass(frozen=True)
class KdaStepMetadata:
    """Everything the KDA layers of one step read; see the module docstring.

    ``state_indices`` int32 ``[G, B]``: request ``b``'s state row for group ``g`` (``-1``: padding).
    ``spec_state_indices`` int32 ``[G, num_decodes, next_n]`` or None (no speculation).
    ``num_accepted_tokens`` int32 ``[num_decodes]`` or None. ``prefill_query_start_loc`` int32
    ``[num_prefills + 1]`` over the prefill tokens (they start at ``num_decodes * next_n``);
    ``prefill_cu_seqlens`` the same as int64 (fla-core's ``chunk_kda``);
    ``has_initial_state`` bool ``[num_prefills]``: the prefill continues an earlier chunk or a
    restored checkpoint.
    """

    state_indices: torch.Tensor
    spec_state_indices: torch.Tensor | None
    num_accepted_tokens: torch.Tensor | None
    num_decodes: int
    next_n: int
    prefill_query_start_loc: torch.Tensor
    prefill_cu_seqlens: torch.Tensor
    has_initial_state: torch.Tensor
    max_prefill_len: int

    @property
    def num_prefills(self) -> int:
        """Prefill requests of the step."""
        return self.state_indices.shape[1] - self.num_decodes

    def decode_state_indices(self, group: int) -> torch.Tensor:
        """The recurrent indices of the decodes for state-row group ``group``: int32 ``[num_decodes]``,
        or ``[num_decodes, next_n]`` under speculation (what :func:`kda_decode` takes)."""
        if self.spec_state_indices is not None:
            return self.spec_state_indices[group]
        return self.state_indices[group, : self.num_decodes]

    def decode_conv_indices(self, group: int) -> torch.Tensor:
        """The conv state indices of the decodes: int32 ``[num_decodes]``."""
        return self.state_indices[group, : self.num_decodes]

    def prefill_state_indices(self, group: int) -> torch.Tensor:
        """The state indices of the prefills: int32 ``[num_prefills]``."""
        return self.state_indices[group, self.num_decodes :]


def build_kda_metadata(
    state_rows: Sequence[Sequence[int] | None],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_decodes: int,
    next_n: int = 1,
    num_accepted_tokens: Sequence[int] | None = None,
    spec_state_rows: Sequence[Sequence[Sequence[int]] | None] | None = None,
    num_rows: int | None = None,
    device: torch.device | str = "cpu",
) -> KdaStepMetadata:
    """Build one step's KDA metadata from the scheduler's host lists (host work, one copy per tensor).

    Args:
        state_rows: per request its ``G`` state rows (``allocator.state_rows(id)``), or None for a
            padded entry; decodes first.
        query_lens, seq_lens: host lengths per request (``seq_len`` includes this step's tokens);
            a prefill with ``seq_len > query_len`` continues from its state.
        num_decodes: the leading requests that decode ``next_n`` tokens each.
        num_accepted_tokens: per decode, how many of its previous step's tokens were accepted
            (1 after a prefill); required when ``next_n > 1``.
        spec_state_rows: per decode ``next_n`` row sets of ``G`` rows (the first equal to its
            ``state_rows``), or None for a padded entry; required when ``next_n > 1``.
        num_rows: the pool's rows; every row is checked against it when given.

    Raises ``ValueError`` for inconsistent lengths, a row outside the pool, or a state row used twice.
    """
    device = device_arg(device)
    batch = len(state_rows)
    query_lens, seq_lens = int_list(query_lens, "query_lens"), int_list(seq_lens, "seq_lens")
    num_decodes, next_n = int_arg(num_decodes, "num_decodes"), int_arg(next_n, "next_n", 1)
    if len(query_lens) != batch or len(seq_lens) != batch or num_decodes > batch:
        raise ValueError(f"{batch} state_rows, {len(query_lens)} query_lens, {len(seq_lens)} seq_lens and "
                         f"num_decodes={num_decodes} disagree")
    groups = _groups(state_rows)
    rows = [[-1] * groups if r is None else int_list(r, f"state_rows[{b}]") for b, r in enumerate(state_rows)]
    if any(len(r) != groups for r in rows):
        raise ValueError(f"every request needs the same number of state rows ({groups})")
    for b in range(batch):
        if query_lens[b] > seq_lens[b] or (b < num_decodes and query_lens[b] != next_n):
            raise ValueError(f"request {b}: query_len={query_lens[b]}, seq_len={seq_lens[b]}; decodes come first "
                             f"with next_n={next_n} tokens and query_len <= seq_len")
    spec = _spec_rows(spec_state_rows, rows, num_decodes, next_n, groups)
    accepted = _accepted(num_accepted_tokens, num_decodes, next_n, state_rows)
    _check_rows(rows, spec, num_rows)
    prefill_lens = query_lens[num_decodes:]
    cu = [0]
    for n in prefill_lens:
        cu.append(cu[-1] + n)
    to = lambda values, dtype: torch.tensor(values, dtype=dtype).to(device, non_blocking=True)  # noqa: E731
    return KdaStepMetadata(
        state_indices=to([list(col) for col in zip(*rows)], torch.int32),
        spec_state_indices=None if spec is None else to(spec, torch.int32).view(groups, num_decodes, next_n),
        num_accepted_tokens=None if accepted is None else to(accepted, torch.int32),
        num_decodes=num_decodes,
        next_n=next_n,
        prefill_query_start_loc=to(cu, torch.int32),
        prefill_cu_seqlens=to(cu, torch.int64),
        has_initial_state=to([s > q for q, s in zip(prefill_lens, seq_lens[num_decodes:])], torch.bool),
        max_prefill_len=max(prefill_lens, default=0),
    )


def _groups(state_rows) -> int:
    for r in state_rows:
        if r is not None:
            return len(r)
    raise ValueError("state_rows has no live request (every entry is None); build no KDA metadata for an empty step")


def _spec_rows(spec_state_rows, rows, num_decodes, next_n, groups):
    """``[G][num_decodes][next_n]`` nested lists, or None without speculation."""
    if next_n == 1:
        if spec_state_rows is not None:
            raise ValueError("spec_state_rows are for next_n > 1 (speculative decode)")
        return None
    if spec_state_rows is None or len(spec_state_rows) != num_decodes:
        raise ValueError(f"next_n={next_n} needs spec_state_rows: {next_n} row sets for each of the "
                         f"{num_decodes} decodes (one recurrent state a token)")
    out = [[[-1] * next_n for _ in range(num_decodes)] for _ in range(groups)]
    for b, sets in enumerate(spec_state_rows):
        if sets is None:
            if rows[b][0] != -1:
                raise ValueError(f"decode {b} has state rows but no spec_state_rows")
            continue
        if len(sets) != next_n:
            raise ValueError(f"spec_state_rows[{b}] has {len(sets)} row sets; next_n={next_n} needs {next_n}")
        sets = [int_list(s, f"spec_state_rows[{b}][{i}]") for i, s in enumerate(sets)]
        if sets[0] != rows[b]:
            raise ValueError(f"spec_state_rows[{b}][0] must be the request's own state rows {rows[b]}")
        for i, s in enumerate(sets):
            if len(s) != groups:
                raise ValueError(f"spec_state_rows[{b}][{i}] needs {groups} rows")
            for g in range(groups):
                out[g][b][i] = s[g]
    return out


def _accepted(num_accepted_tokens, num_decodes, next_n, state_rows):
    if num_accepted_tokens is None:
        if next_n > 1:
            raise ValueError(f"next_n={next_n} needs num_accepted_tokens for the {num_decodes} decodes")
        return None
    accepted = int_list(num_accepted_tokens, "num_accepted_tokens", 1)
    if len(accepted) != num_decodes or any(a > next_n for a in accepted):
        raise ValueError(f"num_accepted_tokens needs {num_decodes} values in [1, {next_n}], got {accepted}")
    return accepted


def _check_rows(rows, spec, num_rows) -> None:
    used = [r for request in rows for r in request if r >= 0]
    if spec is not None:
        for group in spec:
            for sets in group:
                used += [r for r in sets[1:] if r >= 0]
    if num_rows is not None and any(r >= num_rows for r in used):
        raise ValueError(f"a state row is outside the pool's {num_rows} rows")
    if len(set(used)) != len(used):
        raise ValueError("a state row is named twice in one step; each request owns its own")
