"""``dsacache simulate``: replay a synthetic request stream through the row allocator.

The packed layout and the power-of-two layout get the same pool bytes and the same
stream; the report compares peak concurrency, row utilisation, prefix hits and refusals.
A paged (non-hybrid) layout has no power-of-two counterpart and is simulated alone.
"""

from __future__ import annotations

import argparse
import json
import sys

from dsacache.config.model import ConfigError
from dsacache.config.serving import CacheConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``dsacache simulate`` beyond the model and serving ones."""
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (it is drawn only when stderr is a terminal)")


def run(args: argparse.Namespace, configs: list[CacheConfig]) -> int:
    """Plan the layout, replay the default workload, print the report."""
    from dsacache.planner import plan
    from dsacache.sim import default_workload, run_simulation

    if len(configs) != 1:
        raise ConfigError("simulate takes one --tensor-parallel-size, not a list")
    layout = plan(configs[0])
    progress = not args.no_progress and sys.stderr.isatty()
    report = run_simulation(layout, None, default_workload(seed=args.seed), progress=progress)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_text())
    if layout.num_kda_layers and not layout.is_packed and not args.json:
        print(f"note: {layout.config.model.name} has a paged layout: its KDA states live outside this pool, "
              "and the run does not charge their memory")
    return 0
