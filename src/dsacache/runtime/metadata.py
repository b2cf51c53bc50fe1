"""Indexer step metadata: built once per scheduler step, reused by every DSA layer.

A step's batch holds decode requests first (each with ``next_n`` query tokens: one new
token plus the speculative ones), then prefill requests (any number of query tokens,
possibly after a cached prefix). The indexer needs:

* the slot mapping of every scheduled token (``slot_mapping.py``);
* for decodes, the per-token context lengths ``[num_decodes, next_n]``: query row ``i``
  of a request with ``seq_len`` tokens sees ``seq_len - next_n + i + 1`` keys;
* for prefills, chunks of query tokens small enough that the keys they read, gathered
  contiguously, fit the gather workspace, and that their ``[M, num_keys]`` fp32 logits
  fit the logits budget. Chunk planning is host work done once per step from the
  scheduler's own host-side lengths (like FlashInfer's ``plan``); it launches nothing.

Prefill context parallelism is refused: ``NotImplementedError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsacache.dispatch import check_same_device, use_triton
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.runtime.block_table import check_block_table
from dsacache.runtime.checks import describe, int_arg, int_list, optional_int_arg, tensor_arg
from dsacache.runtime.dcp import NO_DCP, DcpSettings, check_dcp
from dsacache.runtime.slot_mapping import compute_slot_mapping

LOGIT_BYTES = 4  # fp32


def decode_context_lens(
    seq_lens: torch.Tensor,
    next_n: int,
    out: torch.Tensor | None = None,
    *,
    check: bool = True,
    impl: str = "auto",
) -> torch.Tensor:
    """int32 ``[B, next_n]``: how many keys each decode query row sees.

    Args:
        seq_lens: int32 ``[B]`` tokens of each request after this step (>= ``next_n``).
        next_n: query tokens per decode request (1 + speculative tokens).
        out: int32 ``[B, next_n]`` contiguous buffer (allocated when omitted).
        check: refuse (``ValueError``, both paths) a ``seq_lens`` entry below ``next_n``; it
            reads ``seq_lens`` back (a device sync): pass ``False`` under CUDA-graph capture,
            where such an entry gives lengths below 1.
        impl: ``"auto"`` (Triton on CUDA tensors, PyTorch otherwise), ``"triton"`` or ``"torch"``.

    >>> decode_context_lens(torch.tensor([10, 3], dtype=torch.int32), 2, impl="torch").tolist()
    [[9, 10], [2, 3]]
    """
    tensor_arg(seq_lens, "seq_lens", torch.int32, 1, "int32 [B]")
    next_n = int_arg(next_n, "next_n", 1)
    if out is None:
        out = torch.empty(seq_lens.numel(), next_n, dtype=torch.int32, device=seq_lens.device)
    what = f"a contiguous int32 [{seq_lens.numel()}, {next_n}]"
    tensor_arg(out, "out", torch.int32, 2, what, contiguous=True)
    if out.shape != (seq_lens.numel(), next_n):
        raise ValueError(f"out must be {what}, got {describe(out)}")
    check_same_device(seq_lens=seq_lens, out=out)
    triton = use_triton(impl, out)
    if check and seq_lens.numel() and int(seq_lens.min()) < next_n:
        raise ValueError(f"seq_lens must be >= next_n={next_n}, got a length of {int(seq_lens.min())}")
    if triton:
        from dsacache.runtime.slot_mapping_triton import launch_decode_context_lens

        return launch_decode_context_lens(seq_lens, out)
    rows = torch.arange(next_n, dtype=torch.int32, device=seq_lens.device)
    out.copy_(seq_lens[:, None] - next_n + 1 + rows[None, :])
    return out


@dataclass(frozen=True)
class PrefillChunk:
    """One indexer prefill launch: a run of query tokens and the keys they read.

    ``query_start:query_end`` index the step's flattened tokens; the chunk covers requests
    ``req_start:req_end`` of the batch (a long request may be split over several chunks).
    Keys are gathered per request, request after request: ``cu_seqlens_k`` [n + 1] int32
    gives each request's offset in the gathered buffer and ``seq_lens_k`` [n] how many of
    its leading keys are gathered. ``ks``/``ke`` (int32 [M]) are each query row's key window
    ``[ks, ke)`` inside the gathered buffer (the ragged logits kernel's inputs).
    """

    query_start: int
    query_end: int
    req_start: int
    req_end: int
    seq_lens_k: torch.Tensor
    cu_seqlens_k: torch.Tensor
    ks: torch.Tensor
    ke: torch.Tensor

    @property
    def num_queries(self) -> int:
        """Query tokens in this chunk."""
        return self.query_end - self.query_start

    @property
    def num_keys(self) -> int:
        """Keys gathered for this chunk: ``cu_seqlens_k[-1]`` (a device sync when it lives on a GPU)."""
        return int(self.cu_seqlens_k[-1])

    @property
    def logits_bytes(self) -> int:
        """Bytes of the fp32 ``[num_queries, num_keys]`` logits of this chunk."""
        return self.num_queries * self.num_keys * LOGIT_BYTES


@dataclass
class _Piece:
    req: int
    context_start: int  # seq_len - query_len: keys before the first query token
    q0: int  # request-local query range [q0, q1)
    q1: int


def _largest_fit(piece_start: int, q_end: int, context: int, m: int, k: int, workspace: int, budget: int) -> int:
    """Largest q1 in [piece_start, q_end] whose chunk still fits, by binary search (fits is monotone)."""

    def fits(q1: int) -> bool:
        keys = k + context + q1
        return keys <= workspace and (m + q1 - piece_start) * keys * LOGIT_BYTES <= budget

    lo, hi = piece_start, q_end
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_prefill_chunks(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    workspace_tokens: int,
    logits_bytes: int,
    first_token: int = 0,
    first_req: int = 0,
    pcp_world_size: int = 1,
    device: torch.device | str = "cpu",
) -> list[PrefillChunk]:
    """Split prefill requests' query tokens into chunks under both budgets (greedy, in order).

    Args:
        query_lens, seq_lens: host lengths of the prefill requests (``seq_len`` counts the
            cached prefix and this step's query tokens).
        workspace_tokens: keys the gather workspace holds per chunk.
        logits_bytes: the most bytes one chunk's ``[M, num_keys]`` fp32 logits may take.
        first_token, first_req: where the prefills start in the step (after the decodes).
        pcp_world_size: prefill context parallelism; only 1 is supported.

    Raises ``ValueError`` when even a single query token does not fit (its context is longer
    than the workspace, or one logits row exceeds the budget).

    >>> [(c.query_start, c.query_end, c.num_keys) for c in plan_prefill_chunks(
    ...     [4, 3], [4, 10], workspace_tokens=12, logits_bytes=1 << 20)]
    [(0, 5, 12), (5, 7, 10)]
    """
    _refuse_pcp(pcp_world_size)
    query_lens, seq_lens = _host_lengths(query_lens, seq_lens)
    workspace_tokens = int_arg(workspace_tokens, "workspace_tokens", 1)
    logits_bytes = int_arg(logits_bytes, "logits_bytes", LOGIT_BYTES)
    first_token, first_req = int_arg(first_token, "first_token"), int_arg(first_req, "first_req")
    chunks, current, m, k = [], [], 0, 0
    for req, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        context, q0 = s_len - q_len, 0
        while q0 < q_len:
            q1 = _largest_fit(q0, q_len, context, m, k, workspace_tokens, logits_bytes)
            if q1 == q0:
                if not current:
                    raise ValueError(
                        f"prefill request {first_req + req}: one query token at position {context + q0} "
                        f"reads {context + q0 + 1} keys, more than workspace_tokens={workspace_tokens} "
                        f"or logits_bytes={logits_bytes} allow"
                    )
                chunks.append(current)
                current, m, k = [], 0, 0
                continue
            current.append(_Piece(req, context, q0, q1))
            m, k, q0 = m + q1 - q0, k + context + q1, q1
    if current:
        chunks.append(current)
    return _materialize(chunks, query_lens, first_token, first_req, device)


def _refuse_pcp(pcp_world_size) -> None:
    if int_arg(pcp_world_size, "pcp_world_size", 1) != 1:
        raise NotImplementedError(
            f"prefill context parallelism (PCP, prefill_context_parallel_size={pcp_world_size}) is not "
            "supported by the packed metadata builder; use prefill_context_parallel_size=1"
        )


def _host_lengths(query_lens, seq_lens) -> tuple[list[int], list[int]]:
    """The host lengths as lists of ints, checked: as many of each, ``0 <= query_len <= seq_len``."""
    query_lens, seq_lens = int_list(query_lens, "query_lens"), int_list(seq_lens, "seq_lens")
    if len(query_lens) != len(seq_lens):
        raise ValueError(f"{len(query_lens)} query_lens but {len(seq_lens)} seq_lens")
    for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        if q_len > s_len:
            raise ValueError(f"request {b}: need query_len <= seq_len, got query_len={q_len}, seq_len={s_len}")
    return query_lens, seq_lens


def _materialize(chunks, query_lens, first_token, first_req, device) -> list[PrefillChunk]:
    starts = [first_token]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    out = []
    for pieces in chunks:
        seq_lens_k = [p.context_start + p.q1 for p in pieces]
        cu = [0]
        for n in seq_lens_k:
            cu.append(cu[-1] + n)
        ks = [cu[i] for i, p in enumerate(pieces) for _ in range(p.q0, p.q1)]
        ke = [cu[i] + p.context_start + q + 1 for i, p in enumerate(pieces) for q in range(p.q0, p.q1)]
        out.append(PrefillChunk(
            query_start=starts[pieces[0].req] + pieces[0].q0,
            query_end=starts[pieces[-1].req] + pieces[-1].q1,
            req_start=first_req + pieces[0].req,
            req_end=first_req + pieces[-1].req + 1,
            seq_lens_k=_int32(seq_lens_k, device),
            cu_seqlens_k=_int32(cu, device),
            ks=_int32(ks, device),
            ke=_int32(ke, device),
        ))
    return out


def _int32(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class IndexerStepMetadata:
    """Everything the indexer layers of one step read; see the module docstring."""

    slot_mapping: torch.Tensor  # [max_num_batched_tokens] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    positions: torch.Tensor  # [num_tokens] int64
    seq_lens: torch.Tensor  # [B] int32
    num_decodes: int
    num_decode_tokens: int
    next_n: int
    decode_context_lens: torch.Tensor  # [num_decodes, next_n] int32
    decode_block_table: torch.Tensor  # [num_decodes, W] int32 (a view of the step's table)
    prefill_chunks: tuple[PrefillChunk, ...]


def build_indexer_metadata(
    block_table: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    slot_mapping: torch.Tensor,
    *,
    next_n: int = 1,
    num_decodes: int | None = None,
    workspace_tokens: int,
    logits_bytes: int,
    num_kernel_pages: int | None = None,
    page_size: int = KERNEL_PAGE_SIZE,
    dcp: DcpSettings = NO_DCP,
    pcp_world_size: int = 1,
    check: bool = True,
    impl: str = "auto",
) -> IndexerStepMetadata:
    """Build one step's indexer metadata from the scheduler's host lengths and the block table.

    Args:
        block_table: int32 ``[B, W]`` kernel-page block table of the step's requests, decodes
            first, on the device the layers run on.
        query_lens, seq_lens: host lengths per request, integers with
            ``0 <= query_len <= seq_len`` (``seq_len`` includes this step's tokens).
        slot_mapping: int64 ``[max_num_batched_tokens]`` contiguous buffer on the block table's
            device, at least ``sum(query_lens)`` long, reused every step.
        next_n: query tokens per decode request.
        num_decodes: leading requests that are decodes; default: the leading run of requests
            with exactly ``next_n`` query tokens and a context before them.
        workspace_tokens, logits_bytes: prefill chunk budgets (:func:`plan_prefill_chunks`).
        num_kernel_pages, page_size: as in :func:`compute_slot_mapping`.
        dcp: this rank's decode context parallelism settings: the slot mapping keeps this
            rank's tokens and the decode context lengths count this rank's share of each
            row's positions (the block table is over local positions); prefills under DCP
            are refused (``NotImplementedError``).
        pcp_world_size: must be 1 (``NotImplementedError`` otherwise).
        check: the slot mapping's page check (:func:`compute_slot_mapping`), one device
            sync; ``False`` keeps the step sync-free. The host lengths are always checked.

    With ``check=False``: one host-to-device copy of the lengths, then device work only.
    """
    _refuse_pcp(pcp_world_size)
    check_dcp(dcp)
    query_lens, seq_lens = _host_lengths(query_lens, seq_lens)
    check_block_table(block_table, len(query_lens))
    next_n = int_arg(next_n, "next_n", 1)
    num_decodes = _count_decodes(query_lens, seq_lens, next_n, num_decodes)
    if dcp.world_size > 1 and num_decodes < len(query_lens):
        raise NotImplementedError(
            f"prefill chunks under decode context parallelism (DCP world_size={dcp.world_size}) are not "
            "built yet: each rank holds only its share of the keys; schedule prefills without DCP"
        )
    _check_slot_buffer(slot_mapping, block_table, sum(query_lens))
    device = block_table.device
    query_start_loc, positions, seq_lens_t = _host_step_tensors(query_lens, seq_lens, device)
    num_decode_tokens = num_decodes * next_n
    chunks = plan_prefill_chunks(
        query_lens[num_decodes:], seq_lens[num_decodes:], workspace_tokens=workspace_tokens,
        logits_bytes=logits_bytes, first_token=num_decode_tokens, first_req=num_decodes, device=device,
    )
    compute_slot_mapping(block_table, query_start_loc, positions, slot_mapping, page_size=page_size,
                         num_kernel_pages=num_kernel_pages, dcp=dcp, check=check, impl=impl)
    # The decode lengths were checked on the host (_count_decodes): no read-back here.
    decode_lens = decode_context_lens(seq_lens_t[:num_decodes], next_n, check=False, impl=impl)
    return IndexerStepMetadata(
        slot_mapping=slot_mapping, query_start_loc=query_start_loc, positions=positions, seq_lens=seq_lens_t,
        num_decodes=num_decodes, num_decode_tokens=num_decode_tokens, next_n=next_n,
        decode_context_lens=decode_lens if dcp.world_size == 1 else dcp.local_len(decode_lens),
        decode_block_table=block_table[:num_decodes], prefill_chunks=tuple(chunks),
    )


def _check_slot_buffer(slot_mapping, block_table, num_tokens: int) -> None:
    tensor_arg(slot_mapping, "slot_mapping", torch.int64, 1, "a contiguous int64 [max_num_batched_tokens] buffer",
               contiguous=True)
    if slot_mapping.numel() < num_tokens:
        raise ValueError(f"slot_mapping has room for {slot_mapping.numel()} tokens; the step schedules {num_tokens}")
    check_same_device(block_table=block_table, slot_mapping=slot_mapping)


def _count_decodes(query_lens, seq_lens, next_n, num_decodes) -> int:
    num_decodes = optional_int_arg(num_decodes, "num_decodes")
    if num_decodes is None:
        num_decodes = 0
        while (num_decodes < len(query_lens) and query_lens[num_decodes] == next_n
               and seq_lens[num_decodes] > next_n):
            num_decodes += 1
    if not 0 <= num_decodes <= len(query_lens):
        raise ValueError(f"num_decodes={num_decodes} must be in [0, {len(query_lens)}]")
    for b in range(num_decodes):
        if query_lens[b] != next_n or seq_lens[b] < next_n:
            raise ValueError(
                f"decode request {b} has query_len={query_lens[b]}, seq_len={seq_lens[b]}; decodes "
                f"come first and have exactly next_n={next_n} query tokens"
            )
    return num_decodes


def _host_step_tensors(query_lens, seq_lens, device):
    """query_start_loc, positions and seq_lens built on the host, copied in one go each."""
    cu, positions = [0], []
    for q_len, s_len in zip(query_lens, seq_lens):
        cu.append(cu[-1] + q_len)
        positions.extend(range(s_len - q_len, s_len))
    return (
        torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True),
        torch.tensor(positions, dtype=torch.int64).to(device, non_blocking=True),
        torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
    )
