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

#: Most rows a simulated pool may have: the allocator keeps a free list as long as the pool,
#: so this bounds the run's memory and start-up time (real pools have thousands of rows).
MAX_SIMULATED_ROWS = 2**20


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
    if layout.num_rows > MAX_SIMULATED_ROWS:
        raise ConfigError(
            f"simulate replays pools of at most {MAX_SIMULATED_ROWS:,} rows; this budget "
            f"({layout.config.cache_memory_bytes:,} B) gives {layout.num_rows:,} rows of {layout.row_bytes:,} B: "
            "lower --kv-cache-memory-bytes"
        )
    progress = not args.no_progress and sys.stderr.isatty()
    report = run_simulation(layout, None, default_workload(seed=args.seed), progress=progress)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.to_text())
    if layout.num_kda_layers and not layout.is_packed and not args.json:
        print(f"note: {layout.config.model.name} has a paged layout: its KDA states live outside this pool, "
              "and the run does not charge their memory")
    return 0
