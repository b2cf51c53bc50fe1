"""A DSA layer's decode step under decode context parallelism (DCP), over ``torch.distributed``.

The ``N`` ranks of a DCP group are ``N`` tensor-parallel ranks; each holds ``H_local`` of the
layer's MLA query heads and its own pool, in which it stores only the tokens it owns (position
``p`` on rank ``(p // interleave) % N``: :class:`~dsacache.runtime.dcp.DcpSettings`). The step
metadata of each rank comes from ``build_indexer_metadata(..., dcp=...)``: its slot mapping is
``-1`` for the tokens another rank stores, its decode context lengths count local positions.
One layer's step, on every rank:

1. all-gather the MLA queries ``[B, next_n, H_local, D]`` over the group (issued first, waited
   for in step 6, so it overlaps the indexer work);
2. store the step's indexer keys and MLA latents of the tokens this rank owns, score its own
   tokens, keep its local top-k (:meth:`DsaDecodeStep.select <dsacache.layers.dsa.DsaDecodeStep.select>`);
3. all-gather the candidates, (score, global position) packed in one int64 each
   (:mod:`~dsacache.parallel.topk_merge`);
4. merge them into the exact global top-k (``global_positions``: the same positions the
   one-GPU top-k picks, ties to the lower position);
5. keep the selected positions this rank owns, as local positions (``owned_positions``);
6. sparse MLA of the group's ``N x H_local`` heads over this rank's selected tokens: a partial
   ``(out, lse)`` per head;
7. merge the partials by LSE so that each rank ends with the exact output of its own heads
   (:mod:`~dsacache.parallel.lse_merge`), by one of :data:`LSE_MERGES`:

   * ``"all_to_all"`` (default): one all-to-all sends each rank the partial outputs and LSEs of
     its heads from every rank, which it merges in fp32;
   * ``"all_gather_reduce_scatter"``: an all-gather of the LSEs, then a reduce-scatter (sum) of
     the outputs each rank has weighted by ``exp(lse_r - lse)``.

   Both move the same output bytes. The all-to-all is one collective instead of two, its LSE
   part is ``N`` times smaller (each rank receives the LSEs of its own heads only), and its
   sum runs in fp32 on the receiver, where a bf16 reduce-scatter rounds every partial sum to
   bf16. The reduce-scatter form is kept to measure the two on NCCL.

KDA (linear-attention) layers are not context-parallel: their recurrent states are replicated
on every rank of the group and run as without DCP; nothing here concerns them.

Every buffer is allocated once per step shape, every collective has a fixed size
(:meth:`DcpDsaDecodeStep.collective_bytes`), and nothing syncs with the host, so a step
captures in a CUDA graph where NCCL allows it (after one eager run has set up the communicator).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsacache.layers.dsa import DsaDecodeInputs, DsaDecodeStep
from dsacache.ops.topk import MAX_TOPK
from dsacache.parallel.lse_merge import merge_partials, merged_lse, weighted_partial
from dsacache.parallel.topk_merge import MAX_POSITIONS, merge_topk, owned_local_positions, pack_candidates
from dsacache.runtime.checks import int_arg, is_int
from dsacache.runtime.dcp import DcpSettings, check_dcp
from dsacache.runtime.metadata import IndexerStepMetadata
from dsacache.runtime.pool import CachePool

#: How the partial attention outputs are merged (see the module docstring).
LSE_MERGES = ("all_to_all", "all_gather_reduce_scatter")

_BACKEND_FOR_DEVICE = {"cuda": "nccl", "cpu": "gloo"}


def gather_into(output: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """All-gather: ``output [N, *tensor.shape]`` (contiguous) gets every rank's ``tensor`` in rank order.
    Passed to torch concatenated along dim 0, the form gloo takes too; ``async_op`` as in torch."""
    # torch 2.13 renames all_gather_into_tensor; both exist there, only the old name before.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output.view(-1, *tensor.shape[1:]), tensor, group=group, async_op=async_op)


def _reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """``output`` gets the sum over the ranks of their ``tensor[rank]`` (``tensor [N, *output.shape]``)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, tensor.view(-1, *output.shape[1:]), group=group)


def check_group(group, dcp: DcpSettings, device: torch.device):
    """``group`` checked against ``dcp`` and the pool's device; ``ValueError`` naming the mismatch.

    ``None`` is the default group (as in ``torch.distributed``). At ``world_size`` 1 no process group
    is needed (the step runs no collective). The backend must serve the device: NCCL for CUDA
    pools, gloo for CPU pools.
    """
    initialized = dist.is_available() and dist.is_initialized()
    if dcp.world_size == 1 and (group is None or not initialized):
        return group
    if not initialized:
        raise ValueError(f"DCP world_size={dcp.world_size} needs an initialized torch.distributed process "
                         "group (torch.distributed.init_process_group), and none is")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != dcp.world_size:
        raise ValueError(f"the process group has {size} ranks but DCP world_size={dcp.world_size} "
                         "(decode_context_parallel_size): pass the group of the DCP ranks")
    if rank != dcp.rank:
        raise ValueError(f"this process is rank {rank} of the process group but DCP rank={dcp.rank}: "
                         "the DCP rank must be the rank in the group")
    backend, need = str(dist.get_backend(group)), _BACKEND_FOR_DEVICE.get(device.type)
    if need is None or need not in backend:
        allowed = ", ".join(f"{b} for {d}" for d, b in _BACKEND_FOR_DEVICE.items())
        raise ValueError(f"the process group's backend is {backend!r} and the pool is on {device}; allowed: {allowed}")
    return group


def collective_bytes(world_size: int, num_rows: int, num_heads_local: int, q_dim: int, kv_lora_rank: int,
                     topk: int, lse_merge: str = "all_to_all") -> dict[str, int]:
    """Bytes each rank receives from the other ranks (and sends to them) per DSA layer and step, by collective.

    With ``N = world_size``, ``R = num_rows`` (``B * next_n``), ``H = num_heads_local``, ``D = q_dim``
    (``kv_lora_rank + rope``), ``r = kv_lora_rank``, ``k = topk``:

    * ``query_all_gather``: ``(N - 1) * R * H * D * 2`` (bf16 queries);
    * ``topk_all_gather``: ``(N - 1) * R * k * 8`` (one int64 a candidate);
    * ``all_to_all`` merge, ``lse_all_to_all``: ``(N - 1) * R * H * (2 r + 4)`` (bf16 outputs, fp32 LSEs);
    * ``all_gather_reduce_scatter`` merge, ``lse_all_gather``: ``(N - 1) * R * N * H * 4`` and
      ``out_reduce_scatter``: ``(N - 1) * R * H * r * 2`` (what a ring reduce-scatter sends a rank).

    Empty at ``N = 1``. K3.1 at TP 8 (``H = 12``, ``D = 576``, ``r = 512``), B = 64, next_n 1, k 2048:

    >>> collective_bytes(4, 64, 12, 576, 512, 2048)
    {'query_all_gather': 2654208, 'topk_all_gather': 3145728, 'lse_all_to_all': 2368512}
    """
    others = world_size - 1
    if others == 0:
        return {}
    rows, h, r = num_rows, num_heads_local, kv_lora_rank
    moved = {"query_all_gather": others * rows * h * q_dim * 2, "topk_all_gather": others * rows * topk * 8}
    if lse_merge == "all_to_all":
        moved["lse_all_to_all"] = others * rows * h * (2 * r + 4)
    else:
        moved["lse_all_gather"] = others * rows * world_size * h * 4
        moved["out_reduce_scatter"] = others * rows * h * r * 2
    return moved


class DcpDsaDecodeStep:
    """Buffers, collectives and the run of a DSA layer's decode step under DCP, for one step shape.

    Args:
        pool: this rank's :class:`~dsacache.runtime.CachePool`; its allocator must hold ``dcp``
            (``RowAllocator.from_layout(layout, dcp=dcp)``), so block tables and slots are over
            this rank's local positions.
        group: the ``torch.distributed`` process group of the DCP ranks (``None``: the default
            group); its size must be ``dcp.world_size`` and this process's rank in it ``dcp.rank``.
            NCCL for a CUDA pool, gloo for a CPU pool.
        dcp: this rank's :class:`~dsacache.runtime.dcp.DcpSettings`.
        batch_size: decode requests in the step (``B``).
        next_n: query tokens a request.
        num_heads_local: MLA query heads of this rank (``H_local``, 12 for K3.1 at TP 8); the
            attention runs over the group's ``H_local x world_size`` heads.
        max_model_len: the longest context (global positions) a request may have.
        softmax_scale: the MLA softmax scale.
        topk: positions kept a row (default: the model's ``index_topk``).
        lse_merge: one of :data:`LSE_MERGES`.

    ``run`` returns the step's ``out [B, next_n, H_local, kv_lora_rank]`` bf16 and
    ``lse [B, next_n, H_local]`` fp32 buffers for this rank's heads, equal (to rounding) to what one
    GPU holding every token computes for them. After a run, ``global_positions`` ``[B * next_n, topk]``
    int32 holds the step's global top-k (ascending, then ``-1``) and ``owned_positions`` the local
    positions of the selected tokens this rank stores (first, ascending, then ``-1``). At
    ``world_size`` 1 it is :class:`~dsacache.layers.dsa.DsaDecodeStep` with no collective (the
    same buffers).

    Example (one process; under ``torchrun`` each rank builds its own, with its rank)::

        >>> from dsacache import CacheConfig, plan
        >>> from dsacache.runtime import CachePool
        >>> pool = CachePool(plan(CacheConfig.from_model("kimi-k3.1"), num_rows=4))
        >>> step = DcpDsaDecodeStep(pool, None, DcpSettings(), batch_size=2, next_n=1, num_heads_local=12,
        ...                         max_model_len=1024, softmax_scale=192 ** -0.5)
        >>> step.collective_bytes()
        {}
    """

    def __init__(self, pool, group, dcp: DcpSettings, *, batch_size: int, next_n: int, num_heads_local: int,
                 max_model_len: int, softmax_scale: float, topk: int | None = None,
                 lse_merge: str = "all_to_all") -> None:
        if not isinstance(pool, CachePool):
            raise ValueError(f"pool must be a CachePool, got {type(pool).__name__}")
        dcp = check_dcp(dcp)
        num_heads_local = int_arg(num_heads_local, "num_heads_local", 1)
        max_model_len = int_arg(max_model_len, "max_model_len", 1)
        if max_model_len > MAX_POSITIONS:
            raise ValueError(f"max_model_len={max_model_len} must be at most {MAX_POSITIONS} (a candidate carries "
                             "its position in 31 bits)")
        if topk is not None and not (is_int(topk) and 1 <= topk <= MAX_TOPK):
            raise ValueError(f"topk={topk!r}; allowed: integers 1..{MAX_TOPK}")
        if lse_merge not in LSE_MERGES:
            raise ValueError(f"lse_merge={lse_merge!r}; allowed: {', '.join(LSE_MERGES)}")
        dcp.check_block_size(pool.layout.block_size)
        if pool.allocator.dcp != dcp:
            raise ValueError(f"the pool's allocator holds {pool.allocator.dcp} but this step is for {dcp}: build the "
                             "rank's allocator with RowAllocator.from_layout(layout, dcp=dcp)")
        heads = pool.layout.config.model.num_attention_heads
        if heads is not None and num_heads_local * dcp.world_size > heads:
            raise ValueError(f"num_heads_local={num_heads_local} x DCP world_size={dcp.world_size} is more than the "
                             f"model's {heads} attention heads")
        self.group = check_group(group, dcp, pool.device)
        self.dcp, self.lse_merge = dcp, lse_merge
        # Every rank's logits are as wide as the busiest rank's (rank 0) share of max_model_len.
        local_len = DcpSettings(dcp.world_size, 0, dcp.interleave).local_len(max_model_len)
        self.local = DsaDecodeStep(pool, batch_size=batch_size, next_n=next_n, num_heads=num_heads_local,
                                   max_model_len=local_len, softmax_scale=softmax_scale, topk=topk)
        self.batch_size, self.next_n, self.num_heads_local = batch_size, next_n, num_heads_local
        self.max_model_len, self.topk = max_model_len, self.local.topk
        model = pool.layout.config.model
        self.kv_lora_rank, self.q_dim = model.kv_lora_rank, model.mla_cached_dim
        # At world_size 1 the one-GPU step's buffers are this step's (every selected token is owned).
        self.global_positions = self.owned_positions = self.local.positions
        self.out, self.lse = self.local.out, self.local.lse
        if dcp.world_size > 1:
            self._allocate(pool.device)

    @property
    def world_size(self) -> int:
        """Ranks of the DCP group."""
        return self.dcp.world_size

    @property
    def num_rows(self) -> int:
        """Query rows of the step: ``batch_size * next_n``."""
        return self.batch_size * self.next_n

    def _allocate(self, device: torch.device) -> None:
        n, b, s, h, r, k = self.world_size, self.batch_size, self.next_n, self.num_heads_local, self.kv_lora_rank, self.topk
        rows = b * s
        self.q_send = torch.empty(b, s, h, self.q_dim, dtype=torch.bfloat16, device=device)
        self.q_recv = torch.empty(n, b, s, h, self.q_dim, dtype=torch.bfloat16, device=device)
        self.q_all = torch.empty(b, s, n * h, self.q_dim, dtype=torch.bfloat16, device=device)
        self.cand_send = torch.empty(rows, k, dtype=torch.int64, device=device)
        self.cand_recv = torch.empty(n, rows, k, dtype=torch.int64, device=device)
        self.cand_work = torch.empty(rows, n, k, dtype=torch.int64, device=device)
        self.global_positions = torch.empty(rows, k, dtype=torch.int32, device=device)
        self.owned_positions = torch.empty(rows, k, dtype=torch.int32, device=device)
        self.part_out = torch.empty(b, s, n * h, r, dtype=torch.bfloat16, device=device)
        self.part_lse = torch.empty(b, s, n * h, dtype=torch.float32, device=device)
        self.out = torch.empty(b, s, h, r, dtype=torch.bfloat16, device=device)
        self.lse = torch.empty(b, s, h, dtype=torch.float32, device=device)
        if self.lse_merge == "all_to_all":
            # Per destination rank: its heads' partial outputs (bf16), then their LSEs (fp32).
            out_bytes = b * s * h * r * 2
            self.send = torch.empty(n, out_bytes + b * s * h * 4, dtype=torch.uint8, device=device)
            self.recv = torch.empty_like(self.send)
            self.send_out, self.send_lse = self._split_chunks(self.send, out_bytes)
            self.recv_out, self.recv_lse = self._split_chunks(self.recv, out_bytes)
        else:
            self.lse_recv = torch.empty(n, b, s, n * h, dtype=torch.float32, device=device)
            self.weighted = torch.empty(n, b, s, h, r, dtype=torch.bfloat16, device=device)

    def _split_chunks(self, buffer: torch.Tensor, out_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Typed views of a ``[N, chunk]`` uint8 all-to-all buffer: ``[N, B, next_n, H_local, rank]`` bf16
        outputs and ``[N, B, next_n, H_local]`` fp32 LSEs."""
        n, b, s, h = self.world_size, self.batch_size, self.next_n, self.num_heads_local
        out = buffer[:, :out_bytes].view(torch.bfloat16).view(n, b, s, h, self.kv_lora_rank)
        lse = buffer[:, out_bytes:].view(torch.float32).view(n, b, s, h)
        return out, lse

    def check(self, meta: IndexerStepMetadata, inputs: DsaDecodeInputs) -> None:
        """``ValueError`` unless ``meta`` and ``inputs`` have this step's shape (host-side, no sync)."""
        q = inputs.q
        want = (self.batch_size, self.next_n, self.num_heads_local, self.q_dim)
        if q.dtype != torch.bfloat16 or tuple(q.shape) != want or q.device != self.local.pool.device:
            raise ValueError(f"inputs.q must be bf16 {list(want)} on {self.local.pool.device} (this rank's "
                             f"num_heads_local={self.num_heads_local} heads), got {tuple(q.shape)} {q.dtype} "
                             f"on {q.device}")
        self.local.check(meta, inputs)

    def run(self, layer: int, meta: IndexerStepMetadata, inputs: DsaDecodeInputs,
            impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """One DSA layer's decode step on this rank; returns the step's ``(out, lse)`` buffers for this
        rank's heads (overwritten per call). Every rank of the group must call it, with the same shapes."""
        self.check(meta, inputs)
        if self.world_size == 1:
            return self.local.run(layer, meta, inputs, impl=impl)
        q = inputs.q if inputs.q.is_contiguous() else self.q_send.copy_(inputs.q)
        queries = gather_into(self.q_recv, q, self.group, async_op=True)
        positions = self.local.select(layer, meta, inputs, impl=impl)
        pack_candidates(self.local.logits, positions, self.dcp, out=self.cand_send)
        gather_into(self.cand_recv, self.cand_send, self.group)
        merge_topk(self.cand_recv, self.topk, out=self.global_positions, work=self.cand_work)
        owned_local_positions(self.global_positions, self.dcp, out=self.owned_positions)
        queries.wait()
        self.q_all.view(self.batch_size, self.next_n, self.world_size, self.num_heads_local, self.q_dim).copy_(
            self.q_recv.permute(1, 2, 0, 3, 4))
        self.local.attend(layer, meta, self.q_all, self.owned_positions, self.part_out, self.part_lse, impl=impl)
        if self.lse_merge == "all_to_all":
            self._merge_all_to_all()
        else:
            self._merge_all_gather_reduce_scatter()
        return self.out, self.lse

    def _by_destination(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, next_n, N * H_local, ...]`` -> a ``[N, B, next_n, H_local, ...]`` view (destination rank first)."""
        b, s, n, h = self.batch_size, self.next_n, self.world_size, self.num_heads_local
        return t.view(b, s, n, h, *t.shape[3:]).movedim(2, 0)

    def _merge_all_to_all(self) -> None:
        self.send_out.copy_(self._by_destination(self.part_out))
        self.send_lse.copy_(self._by_destination(self.part_lse))
        dist.all_to_all_single(self.recv, self.send, group=self.group)
        merge_partials(self.recv_out, self.recv_lse, out=self.out, lse=self.lse)

    def _merge_all_gather_reduce_scatter(self) -> None:
        gather_into(self.lse_recv, self.part_lse, self.group)
        total = merged_lse(self.lse_recv)
        weighted_partial(self._by_destination(self.part_out), self._by_destination(self.part_lse),
                         self._by_destination(total), out=self.weighted)
        _reduce_scatter(self.out, self.weighted, self.group)
        self.lse.copy_(self._by_destination(total)[self.dcp.rank])

    def collective_bytes(self) -> dict[str, int]:
        """Bytes each rank receives from the other ranks (and sends to them) per layer and step, by
        collective: :func:`collective_bytes` of this step's shape. Empty at ``world_size`` 1."""
        return collective_bytes(self.world_size, self.num_rows, self.num_heads_local, self.q_dim, self.kv_lora_rank,
                                self.topk, self.lse_merge)

    def collective_ops(self) -> dict[str, object]:
        """Each collective of the step alone, on the step's buffers, as a no-argument callable keyed like
        :meth:`collective_bytes` (to time them apart from the step; they overwrite the step's buffers)."""
        if self.world_size == 1:
            return {}
        group = self.group
        ops = {"query_all_gather": lambda: gather_into(self.q_recv, self.q_send, group),
               "topk_all_gather": lambda: gather_into(self.cand_recv, self.cand_send, group)}
        if self.lse_merge == "all_to_all":
            ops["lse_all_to_all"] = lambda: dist.all_to_all_single(self.recv, self.send, group=group)
        else:
            ops["lse_all_gather"] = lambda: gather_into(self.lse_recv, self.part_lse, group)
            ops["out_reduce_scatter"] = lambda: _reduce_scatter(self.out, self.weighted, group)
        return ops
