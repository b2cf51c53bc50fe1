"""Replay a request stream step by step through the row allocator (CPU, no tensors).

Each step, like an engine's scheduler: running requests each decode one token (a new
row when a block fills; if none is left, the most recently admitted request is
preempted: freed and queued again at the front, to be recomputed from its prompt), then
waiting requests are admitted in arrival order while rows, ``max_num_seqs`` and the
step's token budget allow. A prompt is prefilled in the step it is admitted (a prompt
longer than the budget is admitted alone). KDA state checkpoints follow the allocator's
policy: an admitted prompt restores the deepest checkpoint its cached blocks reach (those
tokens cost no prefill budget); after the step's admissions each admitted prompt saves one
at each position the policy names, in the rows left; the copies are handed out then.
"""

from __future__ import annotations

import functools
import sys
from array import array
from collections import deque
from dataclasses import dataclass

from dsacache.runtime.allocator import RowAllocator
from dsacache.sim.workload import SimRequest, Workload

#: Utilisation is sampled every this many steps (it walks every row in use).
UTILISATION_EVERY = 4


@dataclass
class LayoutResult:
    """What one layout did with the stream."""

    name: str
    block_size: int
    num_rows: int
    row_bytes: int
    state_rows_per_request: int
    tokens_per_row: int = 0  # block_size x the DCP world size
    num_steps: int = 0
    peak_running: int = 0
    mean_running: float = 0.0
    finished: int = 0
    admission_refusals: int = 0
    rejected: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    utilisation: float = 0.0
    state_row_utilisation: float = 0.0
    attention_row_utilisation: float = 0.0
    prefill_tokens_saved: int = 0  # prompt tokens whose prefill a restored checkpoint skipped
    checkpoints_saved: int = 0
    checkpoint_rows_mean: float = 0.0
    checkpoint_rows_peak: int = 0

    @property
    def prefill_saved_rate(self) -> float:
        """Share of prompt tokens whose prefill checkpoints skipped."""
        return self.prefill_tokens_saved / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def checkpoint_bytes_mean(self) -> float:
        """Mean bytes of the pool holding checkpoints (parked or in use)."""
        return self.checkpoint_rows_mean * self.row_bytes

    @property
    def checkpoint_bytes_peak(self) -> int:
        """Peak bytes of the pool holding checkpoints."""
        return self.checkpoint_rows_peak * self.row_bytes

    @property
    def prefix_hit_rate(self) -> float:
        """Share of prompt tokens served from reused blocks."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def pool_bytes(self) -> int:
        """Bytes of the simulated pool."""
        return self.num_rows * self.row_bytes


@dataclass(eq=False)
class _Running:
    request: SimRequest
    generated: int = 0
    state: str = "running"  # or "finished", "preempted"


@dataclass
class _Usage:
    token_bytes: float = 0.0
    state_bytes: float = 0.0
    attention_bytes: float = 0.0
    state_row_bytes: float = 0.0
    checkpoint_rows: float = 0.0
    samples: int = 0


class Progress:
    """A plain-text progress bar on stderr (redrawn in place, one line per task); drawn only when
    ``enabled`` and stderr is a terminal (a log file or a pipe gets no carriage-return noise)."""

    def __init__(self, label: str, total: int, enabled: bool, width: int = 30) -> None:
        enabled = enabled and sys.stderr.isatty()
        self.label, self.total, self.enabled, self.width = label, max(total, 1), enabled, width
        self._shown = -1

    def update(self, done: int) -> None:
        percent = min(100, 100 * done // self.total)
        percent -= percent % 5 if percent < 100 else 0
        if not self.enabled or percent == self._shown:
            return
        self._shown = percent
        filled = self.width * percent // 100
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r{self.label:<22} [{bar}] {percent:3d}%")
        if percent == 100:
            sys.stderr.write("\n")
        sys.stderr.flush()


class Replay:
    """One layout's replay of one workload; :meth:`run` returns its :class:`LayoutResult`."""

    def __init__(self, name: str, layout, workload: Workload, progress: bool = False) -> None:
        self.name, self.layout, self.workload, self.progress = name, layout, workload, progress
        self.allocator = RowAllocator.from_layout(layout)
        self.result = LayoutResult(name, layout.block_size, layout.num_rows, layout.row_bytes,
                                   layout.state_rows_per_request, layout.tokens_per_row)
        self._usage = _Usage()

    def run(self, max_steps: int = 1_000_000) -> LayoutResult:
        stream = deque(self.workload.requests())
        waiting: deque[SimRequest] = deque()
        running: list[_Running] = []
        bar = Progress(self.name, len(stream), self.progress)
        running_sum, step = 0, 0
        while (stream or waiting or running) and step < max_steps:
            while stream and stream[0].arrival_step <= step:
                waiting.append(stream.popleft())
            running = self._decode(running, waiting)
            self._admit(running, waiting)
            running_sum += len(running)
            self.result.peak_running = max(self.result.peak_running, len(running))
            if step % UTILISATION_EVERY == 0:
                self._sample_usage()
            step += 1
            bar.update(self.result.finished + self.result.rejected)
        if stream or waiting or running:
            raise RuntimeError(f"{self.name}: the stream did not drain in {max_steps} steps")
        bar.update(bar.total)
        return self._finish(step, running_sum)

    def _decode(self, running: list[_Running], waiting: deque) -> list[_Running]:
        queue = list(running)  # admission order: preemption victims come off the end
        for entry in running:
            if entry.state != "running" or not self._make_room(entry, queue, waiting):
                continue
            self.allocator.extend(entry.request.request_id, 1)
            entry.generated += 1
            if entry.generated >= entry.request.output_len:
                self.allocator.free(entry.request.request_id)
                entry.state = "finished"
                self.result.finished += 1
        return [entry for entry in queue if entry.state == "running"]

    def _make_room(self, entry: _Running, queue: list[_Running], waiting: deque) -> bool:
        """Preempt the newest requests until ``entry`` can take a token; False if it was preempted itself."""
        while not self.allocator.can_extend(entry.request.request_id, 1):
            victim = queue.pop()
            if victim.state != "running":
                continue
            self.allocator.free(victim.request.request_id)
            victim.state = "preempted"
            waiting.appendleft(victim.request)
            self.result.preemptions += 1
            if victim is entry:
                return False
        return True

    def _admit(self, running: list[_Running], waiting: deque) -> None:
        budget = self.workload.max_num_batched_tokens - len(running)
        admitted = 0
        while waiting and len(running) < self.workload.max_num_seqs:
            request = waiting[0]
            if self._never_fits(request):
                waiting.popleft()
                self.result.rejected += 1
                continue
            if request.prompt_len > budget and admitted:
                break
            tokens = _prompt_ids(request)
            if not self.allocator.can_add(tokens):
                self.result.admission_refusals += 1
                break
            self.allocator.add(request.request_id, tokens)
            waiting.popleft()
            running.append(_Running(request))
            budget -= request.prompt_len - self.allocator.restored_tokens(request.request_id)
            admitted += 1
        self._checkpoint(running[len(running) - admitted :])

    def _checkpoint(self, admitted: list[_Running]) -> None:
        """After the step's prefills: save the checkpoints the policy names in whatever rows are left
        (admission came first, as a scheduler decides before the forward pass), then hand out the copies."""
        for entry in admitted:
            rid = entry.request.request_id
            for position in self.allocator.checkpoint_positions(rid):
                self.allocator.save_checkpoint(rid, position)
        self.allocator.pop_state_copies()

    def _never_fits(self, request: SimRequest) -> bool:
        """A request whose full length needs more rows than the whole pool is rejected outright."""
        return self.layout.rows_per_request(request.prompt_len + request.output_len) > self.allocator.num_rows

    def _sample_usage(self) -> None:
        """Bytes holding tokens and states vs bytes of the rows they occupy (parked rows excluded)."""
        alloc, layout, usage = self.allocator, self.layout, self._usage
        seen: set[int] = set()
        tokens = 0
        for rid in alloc.request_ids():
            rows, n = alloc.attention_rows(rid), alloc.num_tokens(rid)
            for i, row in enumerate(rows):
                if row not in seen:
                    seen.add(row)
                    tokens += min(alloc.tokens_per_row, n - i * alloc.tokens_per_row)
        num_requests = alloc.num_requests
        # Under DCP each rank stores its share of a row's tokens: count the mean rank's bytes.
        usage.token_bytes += tokens * layout.row_bytes_per_token / layout.config.decode_context_parallel_size
        usage.attention_bytes += len(seen) * layout.row_bytes
        # Only states held in the pool count: a paged layout keeps KDA states outside it.
        if layout.state_rows_per_request:
            usage.state_bytes += num_requests * layout.num_kda_layers * layout.state_bytes
        usage.state_row_bytes += num_requests * layout.state_rows_per_request * layout.row_bytes
        usage.checkpoint_rows += alloc.num_checkpoint_rows
        self.result.checkpoint_rows_peak = max(self.result.checkpoint_rows_peak, alloc.num_checkpoint_rows)
        usage.samples += 1

    def _finish(self, steps: int, running_sum: int) -> LayoutResult:
        result, usage, stats = self.result, self._usage, self.allocator.stats
        result.num_steps = steps
        result.mean_running = running_sum / max(steps, 1)
        result.prompt_tokens, result.hit_tokens = stats.prompt_tokens, stats.hit_tokens
        result.prefill_tokens_saved, result.checkpoints_saved = stats.restored_tokens, stats.checkpoints_saved
        result.checkpoint_rows_mean = _ratio(usage.checkpoint_rows, usage.samples)
        used = usage.token_bytes + usage.state_bytes
        result.utilisation = _ratio(used, usage.attention_bytes + usage.state_row_bytes)
        result.attention_row_utilisation = _ratio(usage.token_bytes, usage.attention_bytes)
        result.state_row_utilisation = _ratio(usage.state_bytes, usage.state_row_bytes)
        self.allocator.check_invariants()
        if self.allocator.num_requests or self.allocator.num_free_rows != self.allocator.num_rows:
            raise RuntimeError(f"{self.name}: rows still held after the stream drained")
        return result


@functools.lru_cache(maxsize=4)
def _prompt_ids(request: SimRequest) -> array:
    """A request's prompt ids, built once while it waits at the head of the queue (it may be refused
    many steps in a row)."""
    return request.prompt_token_ids()


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0
