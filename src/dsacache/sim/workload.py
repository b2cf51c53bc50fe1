"""Synthetic request streams for the simulator (seeded, deterministic, pure Python)."""

from __future__ import annotations

import math
import random
from array import array
from dataclasses import dataclass

#: Token ids of unique prompt parts start here, far above any shared prefix's ids.
_UNIQUE_ID_BASE = 1 << 40
_UNIQUE_ID_STRIDE = 1 << 20


@dataclass(frozen=True)
class SimRequest:
    request_id: int
    arrival_step: int
    prompt_len: int
    output_len: int
    prefix_group: int | None  # which shared prefix the prompt starts with, if any
    prefix_len: int

    def prompt_token_ids(self) -> array:
        """Shared prefix ids (the same for every request of the group), then ids unique to this request
        (an int64 ``array``: the allocator takes it without a copy)."""
        shared = []
        if self.prefix_group is not None:
            start = self.prefix_group * _UNIQUE_ID_STRIDE
            shared = list(range(start, start + self.prefix_len))
        start = _UNIQUE_ID_BASE + self.request_id * _UNIQUE_ID_STRIDE
        return array("q", shared + list(range(start, start + self.prompt_len - len(shared))))


@dataclass(frozen=True)
class Workload:
    """A request stream and the scheduler limits it is replayed under.

    Arrivals are Poisson (``arrival_rate`` requests per step on average); prompt and output
    lengths are log-normal around their medians, clamped to ``[min, max]``. A fraction of
    requests starts with one of ``num_shared_prefixes`` shared prefixes (a system prompt,
    a few-shot header) of ``shared_prefix_len`` tokens.
    """

    num_requests: int = 800
    arrival_rate: float = 6.0
    prompt_len_median: int = 6000
    prompt_len_sigma: float = 0.9
    prompt_len_min: int = 64
    prompt_len_max: int = 65536
    output_len_median: int = 200
    output_len_sigma: float = 0.8
    output_len_min: int = 1
    output_len_max: int = 2048
    shared_prefix_fraction: float = 0.5
    num_shared_prefixes: int = 8
    shared_prefix_len: int = 8192
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 32768
    seed: int = 0

    def __post_init__(self):
        for name in ("num_requests", "prompt_len_min", "output_len_min", "num_shared_prefixes",
                     "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload {name}={getattr(self, name)} must be >= 1")
        if self.arrival_rate <= 0:
            raise ValueError(f"workload arrival_rate={self.arrival_rate} must be > 0")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise ValueError(f"workload shared_prefix_fraction={self.shared_prefix_fraction} must be in [0, 1]")

    def requests(self) -> list[SimRequest]:
        """The stream, in arrival order (the same list for the same workload)."""
        rng = random.Random(self.seed)
        step, out = 0.0, []
        for i in range(self.num_requests):
            step += rng.expovariate(self.arrival_rate)
            out.append(self._request(rng, i, int(step)))
        return out

    def _request(self, rng: random.Random, i: int, arrival: int) -> SimRequest:
        prompt = _lognormal_int(rng, self.prompt_len_median, self.prompt_len_sigma,
                                self.prompt_len_min, self.prompt_len_max)
        output = _lognormal_int(rng, self.output_len_median, self.output_len_sigma,
                                self.output_len_min, self.output_len_max)
        group, prefix = None, 0
        if rng.random() < self.shared_prefix_fraction:
            group = rng.randrange(self.num_shared_prefixes)
            prefix = self.shared_prefix_len
            prompt += prefix
        return SimRequest(i, arrival, prompt, output, group, prefix)


def _lognormal_int(rng: random.Random, median: int, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, int(rng.lognormvariate(math.log(median), sigma))))


def default_workload(seed: int = 0) -> Workload:
    """The embedded workload of ``dsacache simulate``: 800 requests, 6K-token median prompts
    (log-normal, up to 64K), 200-token median outputs, half of them behind one of 8 shared
    8K-token prefixes, arriving faster than a K3.1 TP8 pool on an H200 can serve them, so
    the pool runs full and capacity decides concurrency."""
    return Workload(seed=seed)
