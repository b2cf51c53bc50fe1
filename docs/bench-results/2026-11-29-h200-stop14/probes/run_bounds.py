"""Probe: how fast the MXFP4 store and decode would run with parts of their e2m1 work removed
(wrong bytes and logits; timing only), against the committed kernels and FP8, same run."""
import importlib
import statistics
import sys

import torch

import dsacache.ops.indexer_k_cache.triton_kernels as tk
import dsacache.ops.indexer_logits.gluon_kernels as gk
from dsacache.bench.harness import copy_ceiling_gbps
from dsacache.bench.k_cache import Pool, _check_store, _inputs, _store_fn
from dsacache.bench.logits import HEAD_DIM, make_inputs, make_pages, time_graph
from dsacache.formats.indexer_key import fp8_page_views, mxfp4_page_views
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.ops.indexer_logits.triton_kernels import launch_paged_decode


def store(ceil):
    n = 1 << 20
    num_pages = n // KERNEL_PAGE_SIZE
    pool = Pool("mxfp4", 128, num_pages, 24)
    k, w, b, slots = _inputs(n, 128, num_pages)
    nbytes = n * (256 + 68)
    perms = [slots] + [torch.randperm(num_pages * KERNEL_PAGE_SIZE, device="cuda")[:n] for _ in range(4)]
    orig = tk.launch_norm_mxfp4_loop
    variants = {"committed": orig}
    for name in ("kstore_free_encode", "kstore_no_pack"):
        variants[name] = importlib.import_module(name).launch_norm_mxfp4_loop
    for rnd in range(2):
        for name, fn in variants.items():
            tk.launch_norm_mxfp4_loop = fn
            pool.raw.fill_(0xA5)
            _store_fn("mxfp4", "fused", k, w, b, pool.pages, slots)()
            if name == "committed":
                _check_store("mxfp4", "fused", pool, k, w, b, slots)
            times = [time_graph(_store_fn("mxfp4", "fused", k, w, b, pool.pages, s)) for s in perms]
            ms = statistics.median(times)
            print(f"store round {rnd} {name:20s} {ms * 1e3:7.1f} us {nbytes / ms / 1e6 / ceil:6.1%} "
                  f"(range {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f})", flush=True)
    tk.launch_norm_mxfp4_loop = orig
    del pool, k, w, b, slots, perms
    torch.cuda.empty_cache()


def decode(ceil):
    batch = 64
    orig = gk.paged_decode_mxfp4_kernel
    kernels = {"committed": orig}
    for name in ("gk_shift_only", "gk_pos_only"):
        kernels[name] = importlib.import_module(name).paged_decode_mxfp4_kernel
    fp8_pages = make_pages(batch * 131072 // 64, "fp8", torch.device("cuda"))
    fv, fs = fp8_page_views(fp8_pages, HEAD_DIM)
    pages = make_pages(batch * 131072 // 64, "mxfp4", torch.device("cuda"))
    values, scales = mxfp4_page_views(pages, HEAD_DIM)
    for heads in (32, 64):
        for ctx in (32768, 131072):
            q, w, lens, table = make_inputs(batch, ctx, heads, 1, pages)
            out = torch.empty(batch, ctx, device="cuda")
            fp8 = time_graph(lambda: launch_paged_decode(q, w, lens, fv, fs, table, out, False))
            line = f"decode H={heads} ctx={ctx}: fp8 {fp8 * 1e3:.1f} us (1.7x = {fp8 / 1.7 * 1e3:.1f})"
            nbytes = batch * ctx * 68 + batch * ctx * 4
            for name, kern in kernels.items():
                gk.paged_decode_mxfp4_kernel = kern
                ms = time_graph(lambda: launch_paged_decode(q, w, lens, values, scales, table, out, True))
                line += f" | {name} {ms * 1e3:.1f} us {fp8 / ms:.2f}x {nbytes / ms / 1e6 / ceil:.1%}"
            gk.paged_decode_mxfp4_kernel = orig
            print(line, flush=True)


if __name__ == "__main__":
    ceil = copy_ceiling_gbps()
    print(f"copy ceiling {ceil:.0f} GB/s", flush=True)
    for part in sys.argv[1:] or ["store", "decode"]:
        {"store": store, "decode": decode}[part](ceil)
