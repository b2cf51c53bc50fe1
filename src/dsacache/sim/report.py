"""``run_simulation``: the same stream through the packed and the power-of-two layout."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dsacache.sim.replay import LayoutResult, Replay
from dsacache.sim.workload import Workload

_ROWS = (
    ("block size (tokens)", lambda r: f"{r.block_size}"),
    ("rows in the pool", lambda r: f"{r.num_rows}"),
    ("row size (MiB)", lambda r: f"{r.row_bytes / 2**20:.2f}"),
    ("state rows per request", lambda r: f"{r.state_rows_per_request}"),
    ("peak concurrency", lambda r: f"{r.peak_running}"),
    ("mean concurrency", lambda r: f"{r.mean_running:.1f}"),
    ("steps to drain", lambda r: f"{r.num_steps}"),
    ("row utilisation", lambda r: f"{100 * r.utilisation:.1f}%"),
    ("  attention rows", lambda r: f"{100 * r.attention_row_utilisation:.1f}%"),
    ("  state rows", lambda r: f"{100 * r.state_row_utilisation:.1f}%"),
    ("prefix hit rate", lambda r: f"{100 * r.prefix_hit_rate:.1f}%"),
    ("prefill tokens saved", lambda r: f"{100 * r.prefill_saved_rate:.1f}%"),
    ("  checkpoints saved", lambda r: f"{r.checkpoints_saved}"),
    ("  checkpoint GiB mean", lambda r: f"{r.checkpoint_bytes_mean / 2**30:.2f}"),
    ("  checkpoint GiB peak", lambda r: f"{r.checkpoint_bytes_peak / 2**30:.2f}"),
    ("admission refusals", lambda r: f"{r.admission_refusals}"),
    ("preemptions", lambda r: f"{r.preemptions}"),
    ("rejected (never fit)", lambda r: f"{r.rejected}"),
)
#: Under DCP a row covers more of a request's tokens than its block size.
_DCP_ROWS = (("tokens a row covers", lambda r: f"{r.tokens_per_row}"),)


@dataclass
class SimReport:
    """Per-layout results of one workload; ``results[0]`` is the packed layout.

    Under decode context parallelism (``decode_context_parallel_size`` N > 1) the replay is
    one rank's pool: every rank of the group holds the same rows, each storing its share
    of a row's ``block_size x N`` tokens, so concurrency is the group's and bytes are per rank.
    """

    model: str
    tensor_parallel_size: int
    workload: Workload
    results: list[LayoutResult]
    decode_context_parallel_size: int = 1

    def to_dict(self) -> dict:
        """The report as JSON-ready data."""
        return {
            "model": self.model,
            "tensor_parallel_size": self.tensor_parallel_size,
            "decode_context_parallel_size": self.decode_context_parallel_size,
            "workload": asdict(self.workload),
            "results": [dict(asdict(r), prefix_hit_rate=r.prefix_hit_rate, pool_bytes=r.pool_bytes,
                             prefill_saved_rate=r.prefill_saved_rate, checkpoint_bytes_mean=r.checkpoint_bytes_mean,
                             checkpoint_bytes_peak=r.checkpoint_bytes_peak)
                        for r in self.results],
        }

    def to_text(self) -> str:
        """The report as an aligned text table."""
        w, dcp = self.workload, self.decode_context_parallel_size
        lines = [
            f"simulate: {self.model}, TP {self.tensor_parallel_size}{f', DCP {dcp}' if dcp > 1 else ''}, pool "
            f"{self.results[0].pool_bytes / 2**30:.1f} GiB per rank",
            f"workload: {w.num_requests} requests, {w.arrival_rate:g}/step, prompt median {w.prompt_len_median}, "
            f"output median {w.output_len_median}, {100 * w.shared_prefix_fraction:.0f}% behind "
            f"{w.num_shared_prefixes} shared {w.shared_prefix_len}-token prefixes (seed {w.seed})",
            "",
            f"{'':<24}" + "".join(f"{r.name:>16}" for r in self.results),
        ]
        rows = _ROWS if dcp == 1 else _ROWS[:1] + _DCP_ROWS + _ROWS[1:]
        lines += [f"{label:<24}" + "".join(f"{fmt(r):>16}" for r in self.results) for label, fmt in rows]
        if dcp > 1:
            lines += ["", f"DCP {dcp}: each of the {dcp} ranks holds a pool like this one, with the same rows; "
                          "concurrency is the group's"]
        if len(self.results) == 2 and self.results[1].peak_running:
            packed, pow2 = self.results
            lines += ["", f"packed vs power-of-two: {packed.peak_running / pow2.peak_running:.2f}x peak concurrency "
                          f"in the same {packed.pool_bytes / 2**30:.1f} GiB"]
        return "\n".join(lines)


def run_simulation(layout_packed, layout_pow2=None, workload: Workload | None = None,
                   progress: bool = True) -> SimReport:
    """Replay ``workload`` (default: :func:`default_workload`) through each layout's allocator.

    ``layout_pow2`` defaults to ``layout_packed.with_block_size(layout_packed.pow2_block_size)``
    (the same pool bytes in power-of-two rows); a layout without a power-of-two counterpart
    (a plain paged one) is simulated alone. ``progress`` draws a bar on stderr.
    """
    from dsacache.sim.workload import default_workload

    workload = workload or default_workload()
    if layout_pow2 is None and layout_packed.pow2_block_size:
        layout_pow2 = layout_packed.with_block_size(layout_packed.pow2_block_size)
    named = [(layout_packed.kind, layout_packed)]
    if layout_pow2 is not None:
        named.append(("power-of-two", layout_pow2))
    results = [Replay(name, layout, workload, progress).run() for name, layout in named]
    config = layout_packed.config
    return SimReport(config.model.name, config.tensor_parallel_size, workload, results,
                     config.decode_context_parallel_size)
