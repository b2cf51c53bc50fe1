"""The capacity simulator: a synthetic request stream replayed through the row allocator.

``run_simulation(layout_packed, layout_pow2, workload, progress=True)`` replays the same
stream through the packed layout and through power-of-two rows of the same pool bytes,
and reports peak concurrency, row utilisation, prefix hit rate and refusals.
"""

from dsacache.sim.replay import LayoutResult
from dsacache.sim.report import SimReport, run_simulation
from dsacache.sim.workload import SimRequest, Workload, default_workload

__all__ = ["LayoutResult", "SimReport", "SimRequest", "Workload", "default_workload", "run_simulation"]
