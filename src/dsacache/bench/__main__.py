"""``python -m dsacache.bench SUITE``: time dsacache's kernels on a CUDA device.

Each suite module defines ``add_arguments(parser)`` and ``run(args) -> list[BenchRow]``;
every suite checks correctness before it times anything. ``SUITE --peers DIR`` also times the
other libraries' kernels for the same ops from the pack in ``DIR`` (``dsacache.bench.peers``)
on the suite's inputs, the same way, beside each row; ``args.peers`` is then the loaded
:class:`~dsacache.bench.peers.PeerSet` (None without the option).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dsacache.bench.harness import NoDeviceError, copy_ceiling_gbps, machine_header, print_report, require_cuda
from dsacache.bench.peers import load_peers
from dsacache.cli.main import ArgumentParser

#: suite name -> module under dsacache.bench
SUITES = {
    "dcp": "dsacache.bench.dcp",
    "kda": "dsacache.bench.kda",
    "kcache": "dsacache.bench.k_cache",
    "layer": "dsacache.bench.layer",
    "logits": "dsacache.bench.logits",
    "mla": "dsacache.bench.mla",
    "topk": "dsacache.bench.topk",
}


def build_parser() -> argparse.ArgumentParser:
    """One subcommand per suite."""
    parser = ArgumentParser(prog="dsacache bench", description=__doc__)
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--peers", metavar="DIR",
                        help="also time the peer kernels of the pack in DIR (dg.tar.xz, vc.so.xz, fmla.so) beside "
                             "each row; a missing or failing one is skipped with a line on stderr")
    sub = parser.add_subparsers(dest="suite", required=True)
    for name, module in SUITES.items():
        mod = importlib.import_module(module)
        mod.add_arguments(sub.add_parser(name, parents=[common], help=mod.__doc__.splitlines()[0]))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one suite: machine header, copy ceiling, then its rows."""
    args = build_parser().parse_args(argv)
    try:
        require_cuda()
    except NoDeviceError as exc:
        print(f"dsacache bench: error: {exc}", file=sys.stderr)
        return 2
    header = machine_header()
    if args.peers is not None:
        args.peers = load_peers(args.peers)
        header["peers"] = args.peers.summary()
    ceiling = copy_ceiling_gbps()
    args.ceiling_gbps = ceiling
    rows = importlib.import_module(SUITES[args.suite]).run(args)
    print_report(header, ceiling, rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
