"""A DSA layer's decode step on the packed pool, from one step's metadata.

The model computes, per DSA layer and step, the indexer keys and queries and the MLA
latents and absorbed queries (:class:`DsaDecodeInputs`); this module does everything the
cache owns, in order, without a host sync (so the whole step captures as one CUDA graph):

1. ``fused_norm_store_indexer_keys``: LayerNorm + quantize + store this step's indexer keys;
2. ``store_mla_latents``: this step's MLA latents into the layer's MLA pages;
3. ``paged_decode_logits``: score every cached key of each query row;
4. ``topk_indices``: the ``index_topk`` best positions of each row (ties to the lower one);
5. ``positions_to_slots``: positions -> cache slots through the block table;
6. ``sparse_mla_decode``: attention over the selected slots, ``(out, lse)``.

:class:`DsaDecodeStep` owns the buffers one step shape needs (logits, positions, out, lse),
allocated once and reused by every layer, FlashInfer's "plan once per step, run once per
layer". Decode requests only (``next_n`` query tokens each, decodes first in the step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsacache.ops.indexer_k_cache import fused_norm_store_indexer_keys
from dsacache.ops.indexer_logits import paged_decode_logits
from dsacache.ops.mla_cache import store_mla_latents
from dsacache.ops.sparse_mla import sparse_mla_decode
from dsacache.ops.topk import positions_to_slots, topk_indices
from dsacache.runtime.metadata import IndexerStepMetadata


@dataclass(frozen=True)
class DsaDecodeInputs:
    """One DSA layer's activations for one decode step of ``B`` requests, ``next_n`` tokens each.

    ``T = B * next_n`` tokens, in the step's token order (request after request).
    """

    index_k: torch.Tensor  # [T, index_head_dim] bf16: indexer keys before the key LayerNorm
    index_k_norm_weight: torch.Tensor  # [index_head_dim]
    index_k_norm_bias: torch.Tensor  # [index_head_dim]
    index_q: torch.Tensor  # [B, next_n, index_n_heads, index_head_dim] float8_e4m3fn
    index_weights: torch.Tensor  # [T, index_n_heads] fp32 (query scale, D**-0.5, H**-0.5 folded in)
    kv_c: torch.Tensor  # [T, kv_lora_rank]: compressed latents
    k_pe: torch.Tensor | None  # [T, qk_rope_head_dim] (None when the model caches none)
    q: torch.Tensor  # [B, next_n, H, kv_lora_rank + qk_rope_head_dim] bf16 absorbed queries


class DsaDecodeStep:
    """Buffers and the run of a DSA layer's decode step for one step shape.

    Args:
        pool: the rank's :class:`~dsacache.runtime.CachePool` (packed or paged layout of a DSA model).
        batch_size: decode requests in the step (``B``).
        next_n: query tokens a request (1 + speculative tokens).
        num_heads: MLA query heads on this rank (``CacheConfig.attention_heads_per_rank``).
        max_model_len: columns of the logits buffer (the longest context a request may have).
        softmax_scale: the MLA softmax scale.
        topk: positions kept a row (default: the model's ``index_topk``).

    Example (CPU, PyTorch paths; on CUDA tensors the Triton kernels run)::

        >>> from dsacache import CacheConfig, plan
        >>> from dsacache.runtime import CachePool
        >>> pool = CachePool(plan(CacheConfig.from_model("kimi-k3.1"), num_rows=4))
        >>> step = DsaDecodeStep(pool, batch_size=2, next_n=1, num_heads=12, max_model_len=1024,
        ...                      softmax_scale=192 ** -0.5)
        >>> step.lse.shape
        torch.Size([2, 1, 12])
    """

    def __init__(self, pool, *, batch_size: int, next_n: int, num_heads: int, max_model_len: int,
                 softmax_scale: float, topk: int | None = None) -> None:
        layout = pool.layout
        model = layout.config.model
        if model.indexer is None or not layout.dsa_layers:
            raise ValueError(f"{model.name} has no DSA layers (no dsa_config): there is no indexer step to run")
        for name, value in (("batch_size", batch_size), ("next_n", next_n), ("num_heads", num_heads),
                            ("max_model_len", max_model_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.pool = pool
        self.batch_size, self.next_n, self.num_heads = batch_size, next_n, num_heads
        self.max_model_len = max_model_len
        self.softmax_scale = softmax_scale
        self.topk = model.indexer.topk if topk is None else topk
        self.kv_lora_rank = model.kv_lora_rank
        rows, device = batch_size * next_n, pool.device
        self.logits = torch.empty(rows, max_model_len, dtype=torch.float32, device=device)
        self.positions = torch.empty(rows, self.topk, dtype=torch.int32, device=device)
        self.out = torch.empty(batch_size, next_n, num_heads, model.kv_lora_rank, dtype=torch.bfloat16,
                               device=device)
        self.lse = torch.empty(batch_size, next_n, num_heads, dtype=torch.float32, device=device)

    @property
    def num_tokens(self) -> int:
        """Tokens of the step: ``batch_size * next_n``."""
        return self.batch_size * self.next_n

    def check(self, meta: IndexerStepMetadata, inputs: DsaDecodeInputs) -> None:
        """``ValueError`` unless ``meta`` and ``inputs`` have this step's shape (host-side, no sync)."""
        if meta.num_decodes != self.batch_size or meta.next_n != self.next_n:
            raise ValueError(f"step metadata has {meta.num_decodes} decodes of next_n={meta.next_n}; this step "
                             f"was built for batch_size={self.batch_size}, next_n={self.next_n}")
        expect = {
            "index_k": (self.num_tokens,), "index_q": (self.batch_size, self.next_n), "kv_c": (self.num_tokens,),
            "q": (self.batch_size, self.next_n, self.num_heads),
        }
        for name, lead in expect.items():
            shape = tuple(getattr(inputs, name).shape)
            if shape[:len(lead)] != lead:
                raise ValueError(f"inputs.{name} has shape {shape}; this step needs {lead} leading dims")

    def run(self, layer: int, meta: IndexerStepMetadata, inputs: DsaDecodeInputs,
            impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """One DSA layer's decode step; returns this step's ``(out, lse)`` buffers (overwritten per call).

        ``out`` is ``[B, next_n, H, kv_lora_rank]`` bf16, ``lse`` ``[B, next_n, H]`` fp32 (natural log).
        """
        positions = self.select(layer, meta, inputs, impl=impl)
        return self.attend(layer, meta, inputs.q, positions, self.out, self.lse, impl=impl)

    def select(self, layer: int, meta: IndexerStepMetadata, inputs: DsaDecodeInputs,
               impl: str = "auto") -> torch.Tensor:
        """Steps 1-4: store this step's keys and latents, score every cached key, keep the top-k.

        Returns this step's ``positions`` buffer ``[B * next_n, topk]`` int32 (request positions
        ascending, then ``-1``; overwritten per call); ``logits`` holds the scores they were ranked by.
        """
        self.check(meta, inputs)
        pool, tokens = self.pool, self.num_tokens
        slot_mapping = meta.slot_mapping[:tokens]
        index_pages, mla_pages = pool.index_pages(layer), pool.mla_pages(layer)
        fused_norm_store_indexer_keys(inputs.index_k, inputs.index_k_norm_weight, inputs.index_k_norm_bias,
                                      index_pages, slot_mapping, impl=impl, check_slots=False)
        store_mla_latents(inputs.kv_c, inputs.k_pe, mla_pages, slot_mapping, impl=impl, check_slots=False)
        paged_decode_logits(inputs.index_q, inputs.index_weights, meta.decode_context_lens, index_pages,
                            meta.decode_block_table, self.max_model_len, out=self.logits, impl=impl)
        return topk_indices(self.logits, meta.decode_context_lens.reshape(-1), self.topk, out=self.positions,
                            impl=impl)

    def attend(self, layer: int, meta: IndexerStepMetadata, q: torch.Tensor, positions: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 5-6: ``positions [B * next_n, topk]`` int32 (``-1`` = none) to slots, then sparse MLA of
        ``q [B, next_n, heads, D]`` bf16 over them into ``out [B, next_n, heads, kv_lora_rank]`` bf16 and
        ``lse [B, next_n, heads]`` fp32 (any head count: decode context parallelism attends with the
        heads of its whole group)."""
        slots = positions_to_slots(positions, meta.decode_block_table, self.next_n, self.pool.num_kernel_pages,
                                   impl=impl)
        return sparse_mla_decode(q, self.pool.mla_pages(layer), slots.view(self.batch_size, self.next_n, self.topk),
                                 self.softmax_scale, kv_lora_rank=self.kv_lora_rank, out=out, lse=lse, impl=impl)

    def run_all(self, meta: IndexerStepMetadata, inputs: dict[int, DsaDecodeInputs],
                outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None, impl: str = "auto"
                ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Every DSA layer of the rank in order; ``inputs`` maps each DSA layer number to its inputs.

        The model runs its own projections between layers; here each layer's ``(out, lse)`` is
        copied into ``outputs[layer]`` (allocated when omitted) so later layers do not overwrite it.
        """
        layers = [slot.layer for slot in self.pool.layout.dsa_layers]
        if sorted(inputs) != layers:
            raise ValueError(f"inputs must name every DSA layer {layers}, got {sorted(inputs)}")
        if outputs is None:
            outputs = {layer: (torch.empty_like(self.out), torch.empty_like(self.lse)) for layer in layers}
        for layer in layers:
            out, lse = self.run(layer, meta, inputs[layer], impl=impl)
            outputs[layer][0].copy_(out)
            outputs[layer][1].copy_(lse)
        return outputs
