"""DSA layer decode step: one layer and every DSA layer of a K3.1 TP-8 rank, on one GPU.

The step of :class:`dsacache.layers.DsaDecodeStep` (indexer key store, MLA latent store, paged
logits, top-k, positions to slots, sparse MLA) at ``--batch`` requests of ``--ctx`` tokens, for
each ``--next-n``, as a CUDA-graph replay, checked first (its top-k against the reference top-k
of its own logits). It is the ``dcp`` suite's DCP-1 step (same pool, inputs and byte count:
``dsacache.bench.dcp``); the peers' kernels for the same step are timed by the ``kcache``,
``logits``, ``topk`` and ``mla`` suites with ``--peers``.
"""

from __future__ import annotations

import argparse
import copy

from dsacache.bench import dcp
from dsacache.bench.harness import BenchRow


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=131072)
    parser.add_argument("--next-n", type=int, nargs="+", default=[1, 2])
    parser.add_argument("-k", "--topk", type=int, default=2048)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 24], help="DSA layers a timed step runs")
    parser.add_argument("--pool-gib", type=float, default=32.0, help="pool size")
    parser.add_argument("--impl", default="auto", choices=["auto", "torch"])
    parser.add_argument("--no-graph", action="store_true", help="time the step eagerly, not as a CUDA-graph replay")


def run(args: argparse.Namespace) -> list[BenchRow]:
    rows = []
    for next_n in args.next_n:
        step_args = copy.copy(args)
        step_args.next_n, step_args.interleave = next_n, 1
        for row in dcp.dcp1_rows(step_args).values():
            row.op = "dsa_decode_step"
            row.shape = f"next_n={next_n} " + row.shape
            rows.append(row)
    return rows
