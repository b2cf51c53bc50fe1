"""Top-k positions of fp32 logits rows (and positions -> slots), with torch.topk beside.

The kernel's output must equal the PyTorch reference exactly (same set, same order:
ascending positions, ties to the lower position) before it is timed. Bytes moved: the
logits read once plus the int32 positions written. Times are CUDA-graph replays
(``harness.time_graph``); ``eager_us`` adds the Python launch overhead of one call. With
``--peers``, vLLM's persistent top-k runs on the same rows, its sets checked against the
reference (another choice among tied logits is accepted and noted), and is timed the same way.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from dsacache.bench.harness import BenchRow, CorrectnessError, time_cuda, time_graph
from dsacache.bench.peers import attach_peer, peer_for, topk_agreement
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.ops.topk import positions_to_slots, topk_indices


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--len", dest="lens", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    parser.add_argument("-k", type=int, default=2048)
    parser.add_argument("--sweep", action="store_true", help="also time a few launch settings per shape")
    parser.add_argument("--dist", nargs="+", default=["randn"], choices=list(DISTRIBUTIONS),
                        help="logits rows to time (each checked first): " + "; ".join(
                            f"{name}: {what}" for name, what in DISTRIBUTIONS.items()))
    parser.add_argument("--kernel-times", action="store_true",
                        help="after every timing (the profiler slows later launches): each kernel's "
                             "own time from the CUDA profiler")


#: Launch settings ``--sweep`` times beside the defaults (``TopkConfig`` fields).
SWEEP = [{"select": "triton"}, {"pdl": False}, {"gluon_select_warps": 16}, {"row_warps": 8}, {"row_warps": 32}, {"select_warps": 16},
         {"select_warps": 8}, {"vec": 4}, {"sample_bits": 8}, {"samples": 1024}, {"ties": 64}]


def run_sweep(logits: torch.Tensor, seq_lens: torch.Tensor, k: int, ref: torch.Tensor) -> None:
    from dsacache.ops.topk.launch import TopkConfig, launch_topk

    starts = None  # as topk_indices passes it without row_starts
    out = torch.empty(logits.shape[0], k, dtype=torch.int32, device="cuda")
    for settings in SWEEP:
        cfg = TopkConfig(**settings)
        launch_topk(logits, seq_lens, starts, out, cfg)
        ms = time_graph(lambda: launch_topk(logits, seq_lens, starts, out, cfg))
        print(f"sweep topk {tuple(logits.shape)} {settings}: {ms * 1e3:.1f} us"
              f"{'' if torch.equal(out, ref) else ' WRONG'}", flush=True)


def kernel_times_us(fn, reps: int = 20) -> dict[str, float]:
    """Mean device time of each kernel ``fn`` launches, by kernel name (CUDA profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / reps for e in prof.key_averages() if e.device_time_total > 0}


def print_kernel_times(logits: torch.Tensor, seq_lens: torch.Tensor, k: int) -> None:
    """Each kernel's own device time of one default top-k launch (CUDA profiler)."""
    kernels = kernel_times_us(lambda: topk_indices(logits, seq_lens, k))
    print(f"kernels topk {tuple(logits.shape)}: " + ", ".join(f"{name} {us:.1f} us" for name, us in kernels.items()),
          flush=True)


#: Logits rows the bench can time (``--dist``): what each stresses in the kernels.
DISTRIBUTIONS = {
    "randn": "independent N(0, 1): candidates spread evenly over the row",
    "ramp": "N(0, 1) plus a ramp of 0 -> 6 along the row (recency bias): candidates pile up at the end",
    "ties": "integers 0..49: every value tied thousands of times",
    "sorted": "each row ascending: every candidate in the last slice",
    "mixed": "a third of the rows ReLU'd (exact zeros), every 7th NaN-dotted",
}


def make_logits(rows: int, length: int, seed: int = 0, dist: str = "randn",
                device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, length]`` fp32 logits drawn from ``DISTRIBUTIONS[dist]``, and full lengths."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(rows, length, device=device, generator=gen)
    if dist == "ramp":
        logits += torch.linspace(0, 6, length, device=device)
    elif dist == "ties":
        logits = torch.randint(0, 50, (rows, length), device=device, generator=gen).float()
    elif dist == "sorted":
        logits = logits.sort(dim=1).values
    elif dist == "mixed":
        logits[::3] = logits[::3].relu()
        logits[1::7, ::5] = float("nan")
    elif dist != "randn":
        raise ValueError(f"dist={dist!r}; allowed: {', '.join(DISTRIBUTIONS)}")
    seq_lens = torch.full((rows,), length, dtype=torch.int32, device=device)
    return logits, seq_lens


def check(logits: torch.Tensor, seq_lens: torch.Tensor, k: int) -> torch.Tensor:
    """The kernel against the reference, twice (exact and deterministic); returns the reference."""
    out = topk_indices(logits, seq_lens, k, impl="triton")
    ref = topk_indices(logits, seq_lens, k, impl="torch")
    if not torch.equal(out, ref):
        bad = int((out != ref).any(dim=1).sum())
        raise CorrectnessError(f"top-k differs from the reference in {bad} of {out.shape[0]} rows")
    again = topk_indices(logits, seq_lens, k, impl="triton")
    if not torch.equal(out, again):
        raise CorrectnessError("top-k is not deterministic across two runs")
    return ref


def check_slots(positions: torch.Tensor, block_table: torch.Tensor) -> None:
    out = positions_to_slots(positions, block_table, impl="triton")
    ref = positions_to_slots(positions, block_table, impl="torch")
    if not torch.equal(out, ref):
        raise CorrectnessError("positions_to_slots differs from the reference")


def run(args: argparse.Namespace) -> list[BenchRow]:
    from dsacache.ops.topk.launch import select_kernel

    rows: list[BenchRow] = []
    for batch, length, dist in itertools.product(args.batch, args.lens, args.dist):
        logits, seq_lens = make_logits(batch, length, dist=dist)
        ref = check(logits, seq_lens, args.k)
        ms = time_graph(lambda: topk_indices(logits, seq_lens, args.k))
        eager_ms = time_cuda(lambda: topk_indices(logits, seq_lens, args.k))
        torch_ms = time_graph(lambda: torch.topk(logits, args.k, dim=1))
        nbytes = batch * length * 4 + batch * args.k * 4
        shape = f"B={batch} L={length} k={args.k}" + ("" if dist == "randn" else f" {dist}")
        rows.append(BenchRow("topk_indices", shape, ms, nbytes, args.ceiling_gbps,
                             {"eager_us": f"{eager_ms * 1e3:.1f}", "torch.topk_us": f"{torch_ms * 1e3:.1f}",
                              "select": select_kernel(logits, args.k)}))
        peer = peer_for(args, "topk")
        attach_peer(rows[-1], peer, lambda: peer.make_call(logits, seq_lens, args.k),
                    lambda out: topk_agreement(out, ref, logits), timer=time_graph)
        print(rows[-1].line(), flush=True)

        positions = topk_indices(logits, seq_lens, args.k)
        if args.sweep:
            run_sweep(logits, seq_lens, args.k, positions)
        blocks = length // KERNEL_PAGE_SIZE
        table = torch.randperm(batch * blocks, device="cuda").view(batch, blocks).to(torch.int32)
        check_slots(positions, table)
        ms = time_graph(lambda: positions_to_slots(positions, table))
        rows.append(BenchRow("positions_to_slots", shape, ms, 2 * positions.numel() * 4, args.ceiling_gbps))
        print(rows[-1].line(), flush=True)
    if args.kernel_times:
        for batch, length, dist in itertools.product(args.batch, args.lens, args.dist):
            print_kernel_times(*make_logits(batch, length, dist=dist), args.k)
    return rows
