"""Sparse MLA decode on 656-B fp8_ds_mla entries (K3.1's MLA layer) against the copy ceiling.

The pool holds ``--pool-tokens`` tokens of one layer's MLA pages (4M tokens: 2.7 GB of entries,
far past the L2) with another layer's page between two of this layer's, as in a packed cache;
every query row attends ``--topk`` random valid slots of the whole pool. Every shape is checked
against the PyTorch reference first and not timed if it disagrees.

Reported: time a call (CUDA-graph replay of a window of back-to-back calls over rotating index
sets, median of the windows), the bytes a call must move (the entries gathered, indices, queries,
out and lse) and the GB/s that makes against the copy ceiling, and TFLOP/s counting
``2 * H * topk * (576 + 512)`` a query row, and the kernel that ran (on Hopper the 16-head Gluon
kernel up to 16 heads, the 64-head one from 33, Triton otherwise; ``--sweep`` also times the others). ``build_pool`` and ``build_inputs``
make the inputs, so another kernel can be timed on the very same ones: with ``--peers``,
FlashMLA's sparse decode runs on them (12 heads padded to 64 with zero heads, as a user must),
its output checked against the reference with the same bound, and is timed the same way.
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from dsacache.bench.harness import BenchRow, CorrectnessError, time_cuda, time_graph
from dsacache.bench.peers import attach_peer, peer_for
from dsacache.formats.mla_entry import MlaEntryFormat, encode_entries
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.ops.sparse_mla import sparse_mla_decode

KV_LORA_RANK = 512
ROPE = 64
FMT = MlaEntryFormat.of("fp8_ds_mla", KV_LORA_RANK, ROPE)
#: The shapes of the side-by-side targets: (B, s_q, H).
SHAPES = [(128, 2, 128), (128, 2, 64), (64, 1, 12), (64, 2, 12), (64, 1, 64), (64, 2, 64), (256, 1, 64)]
#: Bounds of the correctness gate (the tests' bounds).
OUT_RMS = 1e-2
LSE_REL = 1e-3
#: Tokens encoded at a time while filling the pool (bounds the fp32 temporaries).
FILL_CHUNK = 1 << 20
#: Index sets a timing window rotates through, so one call's entries are not left in L2 for the next
#: (a window of ``harness.WINDOW`` calls visits each as often).
INDEX_SETS = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", nargs="+", default=[f"{b}x{s}x{h}" for b, s, h in SHAPES],
                        help="BxS_QxH shapes to time (default: the target shapes)")
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--pool-tokens", type=int, default=1 << 22)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of launch settings per shape")


@dataclass
class MlaInputs:
    """One shape's inputs: absorbed queries, ``INDEX_SETS`` index tensors, the softmax scale."""

    q: torch.Tensor
    index_sets: list[torch.Tensor]
    softmax_scale: float

    @property
    def indices(self) -> torch.Tensor:
        return self.index_sets[0]


def build_pool(num_tokens: int, device: torch.device | str, seed: int = 0) -> torch.Tensor:
    """One layer's fp8_ds_mla pages ``[P, 64, 656]`` with another layer's page between two of them
    (page stride two pages), every entry encoded from random latents."""
    num_pages = math.ceil(num_tokens / KERNEL_PAGE_SIZE)
    page = KERNEL_PAGE_SIZE * FMT.entry_bytes
    raw = torch.zeros(num_pages, 2, page, dtype=torch.uint8, device=device)
    pages = raw[:, 1].view(num_pages, KERNEL_PAGE_SIZE, FMT.entry_bytes)
    gen = torch.Generator(device=device).manual_seed(seed)
    flat = pages.view(num_pages, KERNEL_PAGE_SIZE * FMT.entry_bytes)
    step = max(1, FILL_CHUNK // KERNEL_PAGE_SIZE)
    for p in range(0, num_pages, step):
        n = min(step, num_pages - p) * KERNEL_PAGE_SIZE
        kv_c = torch.randn(n, KV_LORA_RANK, device=device, generator=gen)
        k_pe = torch.randn(n, ROPE, device=device, generator=gen)
        flat[p:p + n // KERNEL_PAGE_SIZE] = encode_entries(kv_c, k_pe, FMT).view(-1, flat.shape[1])
    return pages


def build_inputs(batch: int, s_q: int, heads: int, topk: int, pages: torch.Tensor, seed: int = 0) -> MlaInputs:
    """Absorbed bf16 queries ``[batch, s_q, heads, 576]`` and ``INDEX_SETS`` int32 index tensors
    ``[batch, s_q, topk]`` of random valid slots of the whole pool (softmax scale 1/sqrt(192),
    K3.1's ``qk_nope_head_dim + qk_rope_head_dim``)."""
    gen = torch.Generator(device=pages.device).manual_seed(seed)
    q = torch.randn(batch, s_q, heads, FMT.cached_dim, device=pages.device, generator=gen).to(torch.bfloat16)
    num_slots = pages.shape[0] * KERNEL_PAGE_SIZE
    sets = [torch.randint(0, num_slots, (batch, s_q, topk), device=pages.device, generator=gen, dtype=torch.int32)
            for _ in range(INDEX_SETS)]
    return MlaInputs(q, sets, 192 ** -0.5)


def reference(inputs: MlaInputs, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference ``(out, lse)`` on the first index set."""
    return sparse_mla_decode(inputs.q, pages, inputs.indices, inputs.softmax_scale, impl="torch")


def out_error(out: torch.Tensor, ref_out: torch.Tensor) -> float:
    """Relative RMS error of ``out`` against the reference's (NaN if ``out`` holds NaN)."""
    return float((out.double() - ref_out.double()).norm() / ref_out.double().norm().clamp_min(1e-30))


def lse_error(lse: torch.Tensor, ref_lse: torch.Tensor) -> float:
    """Largest relative error of ``lse`` ``[B, s_q, H]`` over the rows the reference has a slot for."""
    live = torch.isfinite(ref_lse)
    return float(((lse[live] - ref_lse[live]).abs() / ref_lse[live].abs().clamp_min(1.0)).max()) if live.any() else 0.0


def check(inputs: MlaInputs, pages: torch.Tensor, config: dict | None = None,
          ref: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    """The Triton path against the reference (``ref``, or computed here) on the first index set;
    the out error, or CorrectnessError."""
    ref_out, ref_lse = reference(inputs, pages) if ref is None else ref
    out, lse = _triton_call(inputs, pages, inputs.indices, config)
    if torch.isnan(out).any() or torch.isnan(lse).any():
        raise CorrectnessError("sparse MLA: NaN in out or lse")
    if not torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)):
        raise CorrectnessError("sparse MLA: rows without a valid slot differ from the reference")
    err, lse_err = out_error(out, ref_out), lse_error(lse, ref_lse)
    if not err < OUT_RMS or not lse_err < LSE_REL:
        raise CorrectnessError(f"sparse MLA: out rel. RMS error {err:.2e} (bound {OUT_RMS:.0e}), "
                               f"lse rel. error {lse_err:.2e} (bound {LSE_REL:.0e})")
    return err


def peer_agreement(peer_out: tuple[torch.Tensor, torch.Tensor],
                   ref: tuple[torch.Tensor, torch.Tensor]) -> tuple[bool, str]:
    """FlashMLA's ``(out [B, s_q, H, 512], lse [B, H, s_q])`` against the reference: judged on
    ``out`` with our bound; the note also gives the lse error against our natural-log lse."""
    out, lse = peer_out
    err = out_error(out, ref[0])
    note = f"out rel. RMS error {err:.1e}, lse rel. error {lse_error(lse.transpose(1, 2), ref[1]):.1e}"
    return err < OUT_RMS, note


def _triton_call(inputs: MlaInputs, pages: torch.Tensor, indices: torch.Tensor, config: dict | None = None):
    if config is None:
        return sparse_mla_decode(inputs.q, pages, indices, inputs.softmax_scale)
    from dsacache.ops.sparse_mla.launch import launch_sparse_mla_decode

    b, s, h = inputs.q.shape[:3]
    out = torch.empty(b, s, h, KV_LORA_RANK, dtype=torch.bfloat16, device=pages.device)
    lse = torch.empty(b, s, h, dtype=torch.float32, device=pages.device)
    launch_sparse_mla_decode(inputs.q, pages, indices, inputs.softmax_scale, FMT, None, out, lse, config)
    return out, lse


def rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call that runs ``calls`` in turn: captured back to back, a window visits every index set."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def time_window(inputs: MlaInputs, pages: torch.Tensor, config: dict | None = None) -> float:
    """Milliseconds a call: ``harness.time_graph`` of calls rotating over the index sets."""
    return time_graph(rotating([lambda idx=idx: _triton_call(inputs, pages, idx, config) for idx in inputs.index_sets]))


def _attach_flashmla(args, row: BenchRow, inputs: MlaInputs, pages: torch.Tensor, ref) -> None:
    """FlashMLA's sparse decode on the same queries, pages and rotating index sets, checked on the
    first set against the reference (12 heads run padded to 64, as a user must)."""
    peer = peer_for(args, "sparse_mla")
    attach_peer(row, peer, lambda: rotating([peer.make_call(inputs.q, pages, idx, inputs.softmax_scale)
                                             for idx in inputs.index_sets]),
                lambda out: peer_agreement(out, ref), timer=time_graph)


def moved_bytes(batch: int, s_q: int, heads: int, topk: int) -> int:
    """Bytes a call must move: each selected entry once, the indices, queries, out and lse."""
    rows = batch * s_q
    return rows * (topk * (FMT.entry_bytes + 4) + heads * (FMT.cached_dim * 2 + KV_LORA_RANK * 2 + 4))


def flops(batch: int, s_q: int, heads: int, topk: int) -> int:
    """Tensor-core work a call: scores over 576 values and the value product over 512, per head and slot."""
    return 2 * batch * s_q * heads * topk * (FMT.cached_dim + KV_LORA_RANK)


#: Launch settings ``--sweep`` times beside the defaults: the Triton kernel's (``launch.CONFIGS`` fields)
#: and the Gluon kernel's (``launch.GLUON_CONFIG``; on Hopper only).
SWEEP = [{"kernel": "triton", **settings} for settings in (
    {}, {"BLOCK_N": 16}, {"BLOCK_N": 32}, {"BLOCK_N": 64}, {"num_stages": 3}, {"num_stages": 6}, {"num_warps": 4},
    {"splits": 1}, {"splits": 2}, {"splits": 4}, {"BH": 32}, {"prefetch": 2}, {"prefetch": 4})]
GLUON_SWEEP = [{"kernel": "gluon", **settings} for settings in (
    {}, {"BLOCK_N": 32, "stages": 3}, {"BLOCK_N": 32, "stages": 4}, {"splits": 1}, {"splits": 2}, {"splits": 4},
    {"l2_ahead": 0}, {"l2_ahead": 1}, {"gather_regs": 136, "value_regs": 160})]
#: The 16-head Gluon kernel's (``launch.GLUON16_CONFIG``; on Hopper, up to 16 heads).
GLUON16_SWEEP = [{"kernel": "gluon16", **settings} for settings in (
    {}, {"l2_ahead": 0}, {"splits": 1}, {"splits": 2}, {"splits": 3}, {"splits": 4})]


def run_sweep(inputs: MlaInputs, pages: torch.Tensor, ceiling: float, nbytes: int, work: int) -> None:
    from dsacache.ops.sparse_mla.launch import decode_kernel

    shape = "x".join(str(d) for d in inputs.q.shape[:3])
    sweep = list(SWEEP)
    for kernel, settings in (("gluon", GLUON_SWEEP), ("gluon16", GLUON16_SWEEP)):
        try:
            decode_kernel(inputs.q, pages, FMT, {"kernel": kernel})
            sweep += settings
        except ValueError:  # not a Hopper GPU, or too many heads for the kernel
            pass
    for settings in sweep:
        try:
            check(inputs, pages, settings)
            ok = ""
        except CorrectnessError as err:
            ok = f" WRONG ({err})"
        except Exception as err:  # a setting that does not compile is reported, not fatal
            print(f"sweep mla {shape} {settings}: failed ({type(err).__name__}: {err})"[:300], flush=True)
            continue
        ms = time_window(inputs, pages, settings)
        gbps = nbytes / (ms * 1e-3) / 1e9
        print(f"sweep mla {shape} {settings}: {ms * 1e3:.1f} us {gbps:.0f} GB/s {gbps / ceiling:.1%} "
              f"{work / (ms * 1e-3) / 1e12:.0f} TFLOP/s{ok}", flush=True)


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        batch, s_q, heads = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not BxS_QxH (e.g. 64x1x12)") from None
    return batch, s_q, heads


def run(args: argparse.Namespace) -> list[BenchRow]:
    from dsacache.ops.sparse_mla.launch import decode_config, decode_kernel

    pages = build_pool(args.pool_tokens, torch.device("cuda"))
    rows: list[BenchRow] = []
    for text in args.shapes:
        batch, s_q, heads = parse_shape(text)
        inputs = build_inputs(batch, s_q, heads, args.topk, pages)
        ref = reference(inputs, pages)
        err = check(inputs, pages, ref=ref)
        ms = time_window(inputs, pages)
        nbytes, work = moved_bytes(batch, s_q, heads, args.topk), flops(batch, s_q, heads, args.topk)
        kernel = decode_kernel(inputs.q, pages, FMT)
        cfg = decode_config(inputs.q, args.topk, None, kernel, FMT.kind)
        eager_ms = time_cuda(lambda: _triton_call(inputs, pages, inputs.indices))
        extra = {"tflops": f"{work / (ms * 1e-3) / 1e12:.0f}", "out_err": f"{err:.1e}", "eager_us": f"{eager_ms * 1e3:.1f}",
                 "config": f"{kernel},BH={cfg['BH']},BLOCK_N={cfg['BLOCK_N']},splits={cfg['splits']}"}
        row = BenchRow("sparse_mla_decode", f"fp8_ds_mla B={batch} s_q={s_q} H={heads} topk={args.topk}", ms,
                       nbytes, args.ceiling_gbps, extra)
        _attach_flashmla(args, row, inputs, pages, ref)
        print(row.line(), flush=True)
        rows.append(row)
        if args.sweep:
            run_sweep(inputs, pages, args.ceiling_gbps, nbytes, work)
    return rows
