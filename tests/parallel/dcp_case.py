"""One DSA decode step set up the same way on one rank (the reference) and on each of N DCP ranks.

The same requests, prompt tokens and step inputs are stored in a one-rank pool and, sharded,
in one pool per DCP rank. Prompt keys are written straight into the pages with values in
{-1, 0, 1} and power-of-two scales, so every indexer score is an exact fp32 number whatever
the order of the sums: ties are real ties on every rank, and the top-k is exactly comparable.
Request 5 has the same key at every position (the top-k is its lowest positions), request 6
zero keys on the last rank (that rank owns tokens but none is selected).

The worker (:func:`run_rank`) runs in spawned processes (``tests/parallel/test_dcp_step.py``).
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dsacache import CacheConfig, plan
from dsacache.formats.indexer_key import fp8_page_views
from dsacache.layers import DsaDecodeInputs, DsaDecodeStep
from dsacache.ops.mla_cache import store_mla_latents
from dsacache.parallel import LSE_MERGES, DcpDsaDecodeStep
from dsacache.runtime import CachePool, DcpSettings, RowAllocator, build_indexer_metadata, compute_slot_mapping
from dsacache.runtime.dcp import NO_DCP

#: A small KDA-hybrid DSA model: K3.1's MLA (512 + 64) and indexer (32 x 128) on 2 DSA layers, and
#: 2 small KDA layers, so that a row is 128 tokens (two kernel pages) and a pool a few MB.
TINY_MODEL = {
    "num_hidden_layers": 4, "num_attention_heads": 32, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
    "mla_use_nope": True,
    "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 32, "head_dim": 64,
                           "short_conv_kernel_size": 4},
    "dsa_config": {"index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
                   "index_k_norm_type": "layernorm"},
}
SCALE = 576 ** -0.5
TOPK = 48
MAX_MODEL_LEN = 512
NUM_ROWS = 40
LAYER = 4
#: Context lengths (at next_n = 1): one token, shorter than k, k, a page + 1, a row + 2, ...
BASE_LENS = (1, 5, 48, 65, 130, 200, 300)
#: Seconds a collective may wait for the other ranks.
GROUP_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class Case:
    world: int
    interleave: int
    next_n: int
    heads_local: int = 4
    seed: int = 0

    @property
    def lens(self) -> tuple[int, ...]:
        return tuple(n + self.next_n - 1 for n in BASE_LENS)

    @property
    def batch(self) -> int:
        return len(BASE_LENS)


def _ternary(shape, gen) -> torch.Tensor:
    return (torch.randint(0, 3, shape, generator=gen) - 1).float()


def make_data(case: Case) -> dict:
    """Every random tensor of the case, on the CPU (saved once, loaded by every rank)."""
    gen = torch.Generator().manual_seed(1000 * case.world + 10 * case.interleave + case.next_n + case.seed)
    last = DcpSettings(case.world, case.world - 1, case.interleave)
    prompts = []
    for b, seq in enumerate(case.lens):
        m = seq - case.next_n
        keys = _ternary((m, 128), gen)
        scales = 2.0 ** -torch.randint(5, 7, (m,), generator=gen).float()
        if b == 5:
            keys[:], scales[:] = keys[0], scales[0]
        if b == 6 and case.world > 1:
            keys[last.owns(torch.arange(m))] = 0.0
        prompts.append({"values": keys.to(torch.float8_e4m3fn), "scales": scales,
                        "kv_c": torch.randn(m, 512, generator=gen).to(torch.bfloat16),
                        "k_pe": torch.randn(m, 64, generator=gen).to(torch.bfloat16)})
    t, heads = case.batch * case.next_n, case.world * case.heads_local
    inputs = {
        "index_k": torch.randn(t, 128, generator=gen).to(torch.bfloat16),
        "index_k_norm_weight": torch.rand(128, generator=gen) + 0.5,
        "index_k_norm_bias": torch.randn(128, generator=gen) * 0.1,
        "index_q": _ternary((case.batch, case.next_n, 32, 128), gen).to(torch.float8_e4m3fn),
        "index_weights": 2.0 ** -torch.randint(4, 7, (t, 32), generator=gen).float(),
        "kv_c": torch.randn(t, 512, generator=gen).to(torch.bfloat16),
        "k_pe": torch.randn(t, 64, generator=gen).to(torch.bfloat16),
        "q": torch.randn(case.batch, case.next_n, heads, 576, generator=gen).to(torch.bfloat16),
    }
    return {"prompts": prompts, "inputs": inputs}


def build(case: Case, data: dict, dcp: DcpSettings, device: str = "cpu"):
    """This rank's pool with the prompts stored (its share under DCP), the step metadata and inputs."""
    config = CacheConfig.from_config_dict(TINY_MODEL, name="tiny", decode_context_parallel_size=dcp.world_size,
                                          cp_kv_cache_interleave_size=dcp.interleave)
    layout = plan(config, num_rows=NUM_ROWS)
    pool = CachePool(layout, device=device, allocator=RowAllocator.from_layout(layout, dcp=dcp))
    pool.buffer.fill_(0x5A)
    ids = [f"r{b}" for b in range(case.batch)]
    for rid, seq in zip(ids, case.lens):
        pool.allocator.add(rid, num_tokens=seq)
    table = pool.allocator.block_table(ids, device=device)
    values, scales = fp8_page_views(pool.index_pages(LAYER), 128)
    for b, prompt in enumerate(data["prompts"]):
        m = prompt["values"].shape[0]
        if m == 0:
            continue
        slots = compute_slot_mapping(table[b:b + 1], torch.tensor([0, m], dtype=torch.int32, device=device),
                                     torch.arange(m, device=device), dcp=dcp,
                                     num_kernel_pages=pool.num_kernel_pages, impl="torch")
        mine = slots >= 0
        page, offset = slots[mine] // 64, slots[mine] % 64
        values[page, offset] = prompt["values"].to(device)[mine]
        scales[page, offset] = prompt["scales"].to(device)[mine]
        store_mla_latents(prompt["kv_c"].to(device), prompt["k_pe"].to(device), pool.mla_pages(LAYER), slots,
                          impl="torch")
    meta = build_indexer_metadata(table, [case.next_n] * case.batch, list(case.lens),
                                  torch.empty(64, dtype=torch.int64, device=device), next_n=case.next_n,
                                  num_decodes=case.batch, workspace_tokens=4096, logits_bytes=1 << 24,
                                  num_kernel_pages=pool.num_kernel_pages, dcp=dcp, impl="torch")
    raw = {name: t.to(device) for name, t in data["inputs"].items()}
    if dcp.world_size > 1:
        h = case.heads_local
        raw["q"] = raw["q"][:, :, dcp.rank * h:(dcp.rank + 1) * h].contiguous()
    return pool, meta, DsaDecodeInputs(**raw)


def reference(case: Case, data: dict, device: str = "cpu", impl: str = "torch") -> dict:
    """The one-rank step over every token and all ``world x heads_local`` heads."""
    pool, meta, inputs = build(case, data, NO_DCP, device)
    step = DsaDecodeStep(pool, batch_size=case.batch, next_n=case.next_n, num_heads=case.world * case.heads_local,
                         max_model_len=MAX_MODEL_LEN, softmax_scale=SCALE, topk=TOPK)
    out, lse = step.run(LAYER, meta, inputs, impl=impl)
    return {"positions": step.positions.cpu().clone(), "out": out.cpu().clone(), "lse": lse.cpu().clone()}


def writable_bytes(pool: CachePool, meta) -> torch.Tensor:
    """Bool mask over ``pool.buffer``: the bytes of this step's keys and latents this rank may write."""
    marks = CachePool(pool.layout, device=pool.device, allocator=pool.allocator)
    marks.buffer.zero_()
    slots = meta.slot_mapping[:meta.num_decode_tokens]
    slots = slots[slots >= 0]
    page, offset = slots // 64, slots % 64
    values, scales = fp8_page_views(marks.index_pages(LAYER), 128)
    values.view(torch.uint8)[page, offset] = 1
    scales.view(torch.int32)[page, offset] = 0x01010101
    marks.mla_pages(LAYER)[page, offset] = 1
    return marks.buffer == 1


def init_group(rank: int, world: int, store_path: str, backend: str) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


def run_rank(rank: int, world: int, store_path: str, work_dir: str, names: list[str], backend: str,
             impl: str) -> None:
    """One DCP rank: every case in ``names`` with each LSE merge, then the refusals; results to ``work_dir``."""
    init_group(rank, world, store_path, backend)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    work = Path(work_dir)
    try:
        for name in names:
            case, data = torch.load(work / f"{name}.data.pt", weights_only=False)
            dcp = DcpSettings(world, rank, case.interleave)
            pool, meta, inputs = build(case, data, dcp, device)
            allowed = writable_bytes(pool, meta)
            for lse_merge in LSE_MERGES:
                step = DcpDsaDecodeStep(pool, None, dcp, batch_size=case.batch, next_n=case.next_n,
                                        num_heads_local=case.heads_local, max_model_len=MAX_MODEL_LEN,
                                        softmax_scale=SCALE, topk=TOPK, lse_merge=lse_merge)
                step.out.fill_(float("nan"))
                step.lse.fill_(float("nan"))
                before = pool.buffer.clone()
                out, lse = step.run(LAYER, meta, inputs, impl=impl)
                changed = pool.buffer != before
                assert not bool((changed & ~allowed).any()), "the step wrote outside this rank's own new tokens"
                torch.save({"global_positions": step.global_positions.cpu(), "owned": step.owned_positions.cpu(),
                            "out": out.cpu(), "lse": lse.cpu(), "bytes": step.collective_bytes()},
                           work / f"{name}.{lse_merge}.rank{rank}.pt")
            check_refusals(case, pool, meta, inputs, dcp)
    finally:
        dist.destroy_process_group()


def check_refusals(case: Case, pool: CachePool, meta, inputs: DsaDecodeInputs, dcp: DcpSettings) -> None:
    """Settings that do not match the group, the pool or the query: ValueError, nothing written."""
    kw = dict(batch_size=case.batch, next_n=case.next_n, num_heads_local=case.heads_local,
              max_model_len=MAX_MODEL_LEN, softmax_scale=SCALE, topk=TOPK)
    world, rank, interleave = dcp.world_size, dcp.rank, dcp.interleave

    def pool_for(settings: DcpSettings) -> CachePool:
        return CachePool(pool.layout, allocator=RowAllocator.from_layout(pool.layout, dcp=settings),
                         device=pool.device)

    refusals = [
        (pool_for(DcpSettings(2 * world, rank, interleave)), DcpSettings(2 * world, rank, interleave),
         f"the process group has {world} ranks but DCP world_size={2 * world}"),
        (pool_for(DcpSettings(world, (rank + 1) % world, interleave)), DcpSettings(world, (rank + 1) % world,
                                                                                    interleave),
         f"this process is rank {rank} of the process group but DCP rank={(rank + 1) % world}"),
        (pool, DcpSettings(world, (rank + 1) % world, interleave), "the pool's allocator holds"),
        (pool, DcpSettings(world, rank, 3), "interleave=3 .* must divide block_size=128"),
    ]
    for bad_pool, settings, match in refusals:
        with pytest.raises(ValueError, match=match):
            DcpDsaDecodeStep(bad_pool, None, settings, **kw)
    step = DcpDsaDecodeStep(pool, None, dcp, **kw)
    before = pool.buffer.clone()
    for q in (torch.cat([inputs.q, inputs.q], dim=2), inputs.q.float()):
        with pytest.raises(ValueError, match="inputs.q must be bf16"):
            step.run(LAYER, meta, dataclasses.replace(inputs, q=q), impl="torch")
    assert torch.equal(pool.buffer, before), "a refused step wrote into the pool"

