"""Probe: the store cases of the bench (FP8 plain and fused, MXFP4 quantize-only and fused) in one
run, the MXFP4 ones also with the e2m1 rounding and packing replaced (wrong bytes; timing only)."""
import importlib
import statistics

import torch

import dsacache.ops.indexer_k_cache.triton_kernels as tk
from dsacache.bench.harness import copy_ceiling_gbps
from dsacache.bench.k_cache import Pool, _check_store, _inputs, _store_fn
from dsacache.bench.logits import time_graph
from dsacache.formats.sizes import KERNEL_PAGE_SIZE

ENTRY = {"fp8": 132, "mxfp4": 68}
CASES = [("fp8", "plain", "committed"), ("fp8", "fused", "committed"),
         ("mxfp4", "quantize", "committed"), ("mxfp4", "quantize", "kstore_free_all"),
         ("mxfp4", "fused", "committed"), ("mxfp4", "fused", "kstore_free_all"),
         ("mxfp4", "fused", "kstore_free_encode")]


def main():
    ceil = copy_ceiling_gbps()
    print(f"copy ceiling {ceil:.0f} GB/s", flush=True)
    n = 1 << 20
    num_pages = n // KERNEL_PAGE_SIZE
    k, w, b, slots = _inputs(n, 128, num_pages)
    perms = [slots] + [torch.randperm(num_pages * KERNEL_PAGE_SIZE, device="cuda")[:n] for _ in range(4)]
    orig = tk.launch_store
    pools = {fmt: Pool(fmt, 128, num_pages, 24) for fmt in ENTRY}
    for rnd in range(2):
        for fmt, mode, variant in CASES:
            pool = pools[fmt]
            tk.launch_store = orig if variant == "committed" else importlib.import_module(variant).launch_store
            try:
                pool.raw.fill_(0xA5)
                _store_fn(fmt, mode, k, w, b, pool.pages, slots)()
                if variant == "committed":
                    _check_store(fmt, mode, pool, k, w, b, slots)
                times = [time_graph(_store_fn(fmt, mode, k, w, b, pool.pages, s)) for s in perms]
                ms = statistics.median(times)
                nbytes = n * (256 + ENTRY[fmt])
                print(f"round {rnd} {fmt:5s} {mode:8s} {variant:18s} {ms * 1e3:7.1f} us "
                      f"{nbytes / ms / 1e6 / ceil:6.1%} (range {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f})",
                      flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"round {rnd} {fmt} {mode} {variant} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    tk.launch_store = orig


if __name__ == "__main__":
    main()
