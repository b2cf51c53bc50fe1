"""Shared benchmark plumbing: machine header, CUDA-event timing, copy ceiling, result rows.

Every benchmark in ``dsacache.bench`` checks its op against the PyTorch reference first
and refuses to time it if the check fails (:class:`CorrectnessError`).
"""

from __future__ import annotations

import datetime
import functools
import json
import platform
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch


class CorrectnessError(RuntimeError):
    """Raised instead of timing an op whose output disagrees with its reference."""


class NoDeviceError(RuntimeError):
    """Raised when a benchmark is asked for on a machine without a CUDA device."""


def require_cuda() -> torch.device:
    """The CUDA device, or :class:`NoDeviceError`."""
    if not torch.cuda.is_available():
        raise NoDeviceError("benchmarks need a CUDA device; none is visible to torch")
    return torch.device("cuda")


def machine_header() -> dict:
    """GPU, SM count, driver-side versions and the date, for the top of every report."""
    props = torch.cuda.get_device_properties(0)
    import triton

    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


#: GPU cycles of the spin kernel queued ahead of a timed launch (~0.5 ms): longer than the host
#: takes to launch a captured graph, so the start event and the graph's kernels run back to back.
SPIN_CYCLES = 1_000_000


def time_cuda(fn: Callable[[], object], warmup: int = 5, rep: int = 30, spin: bool = False) -> float:
    """Median milliseconds of ``fn`` over ``rep`` launches, timed with CUDA events.

    With ``spin`` the GPU is kept busy while the host launches ``fn`` (a spin kernel runs
    before the start event), so the time is the device's alone: without it an idle GPU waits
    for the host between the start event and the first kernel (~10 us for a graph replay),
    which is host overhead, not the op's. Leave it off to time an eager call as a user sees it.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if spin:
            torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_ceiling_gbps(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_cuda(functools.partial(dst.copy_, src), warmup=3, rep=20)
    src = dst = None  # free the 8 GiB before the benchmarks allocate theirs
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


@dataclass
class BenchRow:
    """One timed case. ``bytes_moved`` is the fewest bytes the op must read plus write."""

    op: str
    shape: str
    ms: float
    bytes_moved: int
    ceiling_gbps: float
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Achieved bandwidth: bytes moved over the median time."""
        return self.bytes_moved / (self.ms * 1e-3) / 1e9

    @property
    def floor_ms(self) -> float:
        """Time the bytes would take at the measured copy ceiling."""
        return self.bytes_moved / (self.ceiling_gbps * 1e9) * 1e3

    def as_dict(self) -> dict:
        """The row with GB/s, ratio to the ceiling and floor added."""
        out = asdict(self)
        out.update(gbps=round(self.gbps, 1), ratio=round(self.gbps / self.ceiling_gbps, 3),
                   floor_ms=round(self.floor_ms, 4))
        return out

    def line(self) -> str:
        """One printed line of the report."""
        ratio = self.gbps / self.ceiling_gbps
        extra = " ".join(f"{k}={v}" for k, v in self.extra.items())
        return (f"{self.op:<28} {self.shape:<34} {self.ms * 1e3:>10.1f} us {self.gbps:>8.0f} GB/s "
                f"{ratio:>6.1%} of copy  floor {self.floor_ms * 1e3:>8.1f} us {extra}")


def print_report(header: dict, ceiling_gbps: float, rows: list[BenchRow], json_path: str | None) -> None:
    """Print the header and one line per row; optionally write everything as JSON."""
    print(" ".join(f"{k}={v}" for k, v in header.items()))
    print(f"copy ceiling: {ceiling_gbps:.0f} GB/s (read + write)")
    for row in rows:
        print(row.line())
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"header": header, "copy_ceiling_gbps": ceiling_gbps,
                       "rows": [r.as_dict() for r in rows]}, f, indent=2)
