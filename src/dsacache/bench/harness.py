"""Shared benchmark plumbing: machine header, timing (CUDA events, CUDA-graph windows), copy ceiling,
result rows with an optional peer side.

Every benchmark in ``dsacache.bench`` checks its op against the PyTorch reference first
and refuses to time it if the check fails (:class:`CorrectnessError`).
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import platform
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

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
#: Back-to-back calls captured in one CUDA graph, and how many replays of it give the median.
WINDOW = 20
WINDOWS = 5


def median_ms(measure: Callable[[], float], warmup: int, rep: int) -> float:
    """Median of ``rep`` results of ``measure`` (milliseconds), after ``warmup`` discarded ones."""
    for _ in range(warmup):
        measure()
    return statistics.median(measure() for _ in range(rep))


def window_median_ms(measure_window: Callable[[], float], window: int = WINDOW, windows: int = WINDOWS) -> float:
    """Milliseconds per call: the median of ``windows`` timed windows of ``window`` calls each,
    over ``window``. One window is replayed first and not counted (it pages the graph in)."""
    _check_window(window, windows)
    return median_ms(measure_window, warmup=1, rep=windows) / window


def _check_window(window: int, windows: int) -> None:
    if window < 1 or windows < 1:
        raise ValueError(f"window={window}, windows={windows}; both must be >= 1")


def _event_ms(fn: Callable[[], object], spin: bool) -> float:
    """Milliseconds of one launch of ``fn`` between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if spin:
        torch.cuda._sleep(SPIN_CYCLES)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


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
    return median_ms(lambda: _event_ms(fn, spin), warmup=0, rep=rep)


def capture_graph(fn: Callable[[], object], calls: int = 1, error_mode: str = "global") -> torch.cuda.CUDAGraph:
    """``calls`` back-to-back calls of ``fn`` captured in one CUDA graph.

    ``fn`` runs once first on a side stream (compilation, lazy allocations stay out of the
    graph). ``error_mode`` is ``torch.cuda.graph``'s ``capture_error_mode`` (``"thread_local"``
    when another thread, such as NCCL's watchdog, touches CUDA during the capture).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=error_mode):
        for _ in range(calls):
            fn()
    return graph


def time_graph(fn: Callable[[], object], window: int = WINDOW, windows: int = WINDOWS) -> float:
    """Milliseconds per call of ``fn``, device time, as a CUDA-graph-captured decode step runs it.

    ``fn`` runs once on a side stream (compilation, lazy allocations), then ``window``
    back-to-back calls are captured in one CUDA graph; the graph is replayed ``windows``
    times behind a spin kernel (see :func:`time_cuda`) and the median replay is divided by
    ``window``. dsacache's ops and the peers' (``dsacache.bench.peers``) are timed by this
    one function, so their times compare.
    """
    _check_window(window, windows)
    graph = capture_graph(fn, calls=window)
    return window_median_ms(lambda: _event_ms(graph.replay, spin=True), window, windows)


def in_turn(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs ``calls`` one a call, in order from the first, round and round.

    Timed as a window of back-to-back calls (:func:`time_graph`), calls on disjoint inputs
    taken in turn keep each call from finding in L2 what the call before it read.
    """
    if not calls:
        raise ValueError("in_turn needs at least one call")
    if len(calls) == 1:
        return calls[0]
    turn = itertools.count()

    def call():
        return calls[next(turn) % len(calls)]()

    return call


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
    """One timed case. ``bytes_moved`` is the fewest bytes the op must read plus write.

    With a peer (``--peers``), ``peer`` names the other library's kernel run on the same
    inputs, ``peer_ms`` is its time (same bytes, same timing) and ``peer_note`` says why it
    has no time (it failed, or disagreed with the reference) or what to know about it.
    """

    op: str
    shape: str
    ms: float
    bytes_moved: int
    ceiling_gbps: float
    extra: dict = field(default_factory=dict)
    peer: str | None = None
    peer_ms: float | None = None
    peer_note: str | None = None

    @property
    def gbps(self) -> float:
        """Achieved bandwidth: bytes moved over the median time."""
        return self.bytes_moved / (self.ms * 1e-3) / 1e9

    @property
    def floor_ms(self) -> float:
        """Time the bytes would take at the measured copy ceiling."""
        return self.bytes_moved / (self.ceiling_gbps * 1e9) * 1e3

    @property
    def peer_gbps(self) -> float | None:
        """The peer's bandwidth on the same bytes, or None without a peer time."""
        return None if self.peer_ms is None else self.bytes_moved / (self.peer_ms * 1e-3) / 1e9

    @property
    def peer_ratio(self) -> float | None:
        """Peer time over ours (above 1: dsacache is faster), or None without a peer time."""
        return None if self.peer_ms is None else self.peer_ms / self.ms

    def as_dict(self) -> dict:
        """The row with GB/s, ratio to the ceiling and floor added; the peer's side when it has one."""
        out = asdict(self)
        out.update(gbps=round(self.gbps, 1), ratio=round(self.gbps / self.ceiling_gbps, 3),
                   floor_ms=round(self.floor_ms, 4))
        if self.peer is None:
            for key in ("peer", "peer_ms", "peer_note"):
                del out[key]
        elif self.peer_ms is not None:
            out.update(peer_gbps=round(self.peer_gbps, 1), peer_of_ceiling=round(self.peer_gbps / self.ceiling_gbps, 3),
                       peer_ratio=round(self.peer_ratio, 3))
        return out

    def line(self) -> str:
        """One printed line of the report (the peer's side after a ``|``)."""
        ratio = self.gbps / self.ceiling_gbps
        extra = " ".join(f"{k}={v}" for k, v in self.extra.items())
        text = (f"{self.op:<28} {self.shape:<34} {self.ms * 1e3:>10.1f} us {self.gbps:>8.0f} GB/s "
                f"{ratio:>6.1%} of copy  floor {self.floor_ms * 1e3:>8.1f} us {extra}")
        return text.rstrip() + self._peer_text()

    def _peer_text(self) -> str:
        if self.peer is None:
            return ""
        note = f" ({self.peer_note})" if self.peer_note else ""
        if self.peer_ms is None:
            return f" | {self.peer}: not timed{note}"
        return (f" | {self.peer}: {self.peer_ms * 1e3:.1f} us {self.peer_gbps:.0f} GB/s "
                f"{self.peer_gbps / self.ceiling_gbps:.1%} of copy, peer/ours {self.peer_ratio:.2f}x{note}")


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
