"""Probe: the store's memory pattern alone (no quantization): read a 256-byte bf16 key row a
token, write VALUE_BYTES + SCALE_BYTES of it (xor-folded) at its slot of a layer's pages in a
24-layer packed pool, random or sorted slots. What the memory system gives this access
pattern, against the copy ceiling of the same run."""
import statistics

import torch
import triton
import triton.language as tl

from dsacache.bench.harness import copy_ceiling_gbps
from dsacache.bench.k_cache import Pool
from dsacache.bench.logits import time_graph
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.ops.indexer_k_cache.triton_kernels import launch_store


@triton.jit
def _pattern_kernel(k_ptr, slot_ptr, pages_ptr, page_stride, n,
                    VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, BLOCK: tl.constexpr,
                    LOOP: tl.constexpr, LOAD_HINT: tl.constexpr = "", VALUE_HINT: tl.constexpr = "",
                    SCALE_HINT: tl.constexpr = ""):
    VW: tl.constexpr = VALUE_BYTES // 4
    for it in range(LOOP):
        t = (tl.program_id(0) * LOOP + it) * BLOCK + tl.arange(0, BLOCK)
        m = t < n
        w = tl.arange(0, 64)
        x = tl.load(k_ptr + t.to(tl.int64)[:, None] * 64 + w[None, :], mask=m[:, None], other=0,
                    eviction_policy=LOAD_HINT)
        y = tl.sum(tl.reshape(x, [BLOCK, 64 // VW, VW]), axis=1)          # [BLOCK, VW]
        slot = tl.load(slot_ptr + t, mask=m, other=0)
        base = pages_ptr + (slot // 64).to(tl.int64) * page_stride
        row = slot % 64
        vp = (base + row * VALUE_BYTES).to(tl.pointer_type(tl.int32))
        tl.store(vp[:, None] + tl.arange(0, VW)[None, :], y, mask=m[:, None], eviction_policy=VALUE_HINT)
        s = tl.sum(y, axis=1)
        if SCALE_BYTES == 4:
            sp = (base + 64 * VALUE_BYTES + row * 4).to(tl.pointer_type(tl.int32))
            tl.store(sp, s, mask=m, eviction_policy=SCALE_HINT)


LAST = "evict_last"
FIRST = "evict_first"
HINTED = [(b, w, 1, h) for b, w in ((16, 4), (8, 2), (32, 8)) for h in (
    {}, {"SCALE_HINT": LAST}, {"SCALE_HINT": LAST, "VALUE_HINT": FIRST},
    {"SCALE_HINT": LAST, "LOAD_HINT": FIRST}, {"SCALE_HINT": LAST, "VALUE_HINT": FIRST, "LOAD_HINT": FIRST},
    {"SCALE_HINT": LAST, "VALUE_HINT": LAST}, {"SCALE_HINT": LAST, "VALUE_HINT": LAST, "LOAD_HINT": FIRST})]


def time_format(fmt, vbytes, ceil, k, k_bf16, perms, sorted_slots):
    n, num_pages = k.shape[0], k.shape[0] // KERNEL_PAGE_SIZE
    pool = Pool(fmt, 128, num_pages, 24)
    nbytes = n * (256 + vbytes + 4)
    for block, warps, loop, hints in HINTED:
        grid = (triton.cdiv(n, block * loop),)
        line = f"{fmt:5s} values {vbytes:3d} B  BLOCK={block:2d} warps={warps} loop={loop:2d} {hints}:"
        for name, slot_sets in (("random", perms), ("sorted", [sorted_slots])):
            times = []
            for s in slot_sets:
                def fn(s=s, grid=grid, block=block, loop=loop, warps=warps, hints=hints):
                    _pattern_kernel[grid](k, s, pool.pages, pool.page_stride, n, VALUE_BYTES=vbytes, SCALE_BYTES=4,
                                          BLOCK=block, LOOP=loop, num_warps=warps, **hints)
                times.append(time_graph(fn))
            ms = statistics.median(times)
            line += f"  {name} {ms * 1e3:6.1f} us {nbytes / ms / 1e6 / ceil:6.1%}"
        print(line, flush=True)
    # (The logs of this stop cast the slots to int64 inside the timed graph here: 5-7 us too slow.)
    times = [time_graph(lambda s=s: launch_store(k_bf16, pool.pages, s, fmt)) for s in perms]
    ms = statistics.median(times)
    print(f"{fmt:5s} committed launch_store (no norm), random slots: {ms * 1e3:6.1f} us "
          f"{nbytes / ms / 1e6 / ceil:6.1%}", flush=True)


def main():
    ceil = copy_ceiling_gbps()
    print(f"copy ceiling {ceil:.0f} GB/s", flush=True)
    n = 1 << 20
    num_slots = n  # the pool has n // 64 pages: every slot is written once
    k = torch.randint(-2**31, 2**31 - 1, (n, 64), dtype=torch.int32, device="cuda")
    perms = [torch.randperm(num_slots, device="cuda").to(torch.int32) for _ in range(3)]
    k_bf16 = torch.randn(n, 128, device="cuda", dtype=torch.bfloat16)
    sorted_slots = torch.arange(n, device="cuda", dtype=torch.int32)
    for fmt, vbytes in (("mxfp4", 64), ("fp8", 128)):
        time_format(fmt, vbytes, ceil, k, k_bf16, perms, sorted_slots)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
