"""Sparse MLA decode: the Triton kernel against the PyTorch reference, closed forms, edge slots, refusals."""

import functools
import math

import pytest
import torch

from dsacache import CacheConfig, plan
from dsacache.formats.mla_entry import MlaEntryFormat, decode_entries, encode_entries
from dsacache.ops.sparse_mla import sparse_mla_decode
from dsacache.runtime import CachePool
from tests.helpers import PTXAS_USAGE, rel_rms_error, run_compiled_script, triton_available

SENTINEL = 0xA5
#: out is bf16: its own rounding is 2**-9 relative, and the kernel also rounds the softmax weights
#: (times the tile scale, for fp8_ds_mla) to bf16 for the value product: relative RMS error
#: 1.7e-3 (bf16, fp8 entries) to 2.7e-3 (fp8_ds_mla) seen; 1e-2 the bound.
OUT_RMS = 1e-2
#: lse comes from fp32 sums of exact products (e4m3 and bf16 values are exact in bf16, tile
#: scales are applied in fp32): ~1e-7 relative seen. The bound, relative to max(|lse|, 1) as lse
#: may be near 0: 1e-3 for every element.
LSE_REL = 1e-3
#: The entry kinds: (kv_cache_dtype, kv_lora_rank, rope) -> 656 B, 528 B, 1152 B, 576 B.
KINDS = [("fp8_ds_mla", 512, 64), ("fp8_ds_mla", 512, 0), ("bfloat16", 512, 64), ("fp8", 512, 64)]
KIND_IDS = ["ds_mla_656", "ds_mla_528", "bf16", "fp8"]

INTERPRET = pytest.mark.skipif(not triton_available(), reason="needs triton")


def make_pages(fmt, num_pages, device, page_stride=None, offset=0, k_scale=None, seed=0, latents=None):
    """(raw sentinel buffer, paged view into it with every entry written): a layer's pages inside
    wider sub-rows when ``page_stride`` is larger than a page."""
    stride = page_stride or 64 * fmt.entry_bytes
    raw = torch.full((num_pages * stride + offset,), SENTINEL, dtype=torch.uint8, device=device)
    pages = raw.as_strided((num_pages, 64, fmt.entry_bytes), (stride, fmt.entry_bytes, 1), offset)
    fill_pages(pages, fmt, k_scale, seed, latents)
    return raw, pages


def fill_pages(pages, fmt, k_scale=None, seed=0, latents=None):
    """Write random entries (or ``latents = (kv_c, k_pe)``) into every slot of ``pages``."""
    gen = torch.Generator().manual_seed(seed)
    tokens = pages.shape[0] * 64
    if latents is None:
        kv_c = torch.randn(tokens, fmt.kv_lora_rank, generator=gen) * 2
        k_pe = torch.randn(tokens, fmt.rope_dim, generator=gen) if fmt.rope_dim else None
    else:
        kv_c, k_pe = latents
    scale = None if k_scale is None else k_scale.cpu()
    entries = encode_entries(kv_c, k_pe, fmt, scale).view(pages.shape[0], 64, fmt.entry_bytes)
    pages.copy_(entries.to(pages.device))


def make_queries(batch, s_q, heads, fmt, device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, s_q, heads, fmt.cached_dim, generator=gen).to(torch.bfloat16).to(device)


def random_indices(batch, s_q, topk, num_slots, device, seed=2, none_every=7):
    """Random slots with ``-1`` scattered through the rows (not only at the end)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, num_slots, (batch, s_q, topk), generator=gen, dtype=torch.int32)
    idx.view(-1)[::none_every] = -1
    return idx.to(device)


def k_scale_for(kind, device):
    return torch.tensor([0.03], device=device) if kind == "fp8" else None


def assert_close_to_reference(out, lse, ref_out, ref_lse):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "unwritten (NaN) outputs"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows without a valid slot differ"
    empty = torch.isneginf(ref_lse)
    assert bool((out[empty] == 0).all()), "a row without a valid slot must give out = 0"
    assert rel_rms_error(out, ref_out) < OUT_RMS
    live = ~empty
    if live.any():
        rel = (lse[live] - ref_lse[live]).abs() / ref_lse[live].abs().clamp_min(1.0)
        assert float(rel.max()) < LSE_REL


def run(q, pages, idx, scale, impl, **kw):
    """The public call with NaN-prefilled outputs (every element must be written)."""
    batch, s_q, heads = q.shape[:3]
    rank = kw.get("kv_lora_rank", 512)
    out = torch.full((batch, s_q, heads, rank), float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full((batch, s_q, heads), float("nan"), dtype=torch.float32, device=q.device)
    got = sparse_mla_decode(q, pages, idx, scale, out=out, lse=lse, impl=impl, **kw)
    assert got[0] is out and got[1] is lse
    return out, lse


def launch(q, pages, idx, scale, fmt, k_scale, config):
    """The launcher with explicit settings (split counts the interpreter never picks by itself)."""
    from dsacache.ops.sparse_mla.launch import launch_sparse_mla_decode

    out = torch.full((*q.shape[:3], fmt.kv_lora_rank), float("nan"), dtype=torch.bfloat16, device=q.device)
    lse = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)
    launch_sparse_mla_decode(q, pages, idx, scale, fmt, k_scale, out, lse, config)
    return out, lse


# ---------------------------------------------------------------- CPU interpreter (small shapes)

@INTERPRET
@pytest.mark.interpret
@pytest.mark.parametrize("kind,rank,rope", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("heads", [1, 12, 16, 64, 128])
def test_matches_reference_every_kind_and_head_count(kind, rank, rope, heads):
    fmt = MlaEntryFormat.of(kind, rank, rope)
    k_scale = k_scale_for(kind, "cpu")
    raw, pages = make_pages(fmt, 3, "cpu", page_stride=64 * fmt.entry_bytes + 4096, offset=1024, k_scale=k_scale)
    before = raw.clone()
    q = make_queries(2, 2, heads, fmt, "cpu")
    idx = random_indices(2, 2, 65, 3 * 64, "cpu")
    scale = fmt.cached_dim ** -0.5
    ref = run(q, pages, idx, scale, "torch", k_scale=k_scale)
    got = run(q, pages, idx, scale, "triton", k_scale=k_scale)
    assert_close_to_reference(*got, *ref)
    assert torch.equal(raw, before), "the read wrote the pool"


@INTERPRET
@pytest.mark.interpret
@pytest.mark.parametrize("s_q", [1, 2, 3, 4])
@pytest.mark.parametrize("topk", [1, 63, 65, 128])
def test_query_rows_and_topk_not_a_multiple_of_the_step(s_q, topk):
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    raw, pages = make_pages(fmt, 2, "cpu")
    q = make_queries(2, s_q, 12, fmt, "cpu", seed=s_q)
    idx = random_indices(2, s_q, topk, 128, "cpu", seed=topk, none_every=5)
    ref = run(q, pages, idx, 0.05, "torch")
    got = run(q, pages, idx, 0.05, "triton")
    assert_close_to_reference(*got, *ref)


@INTERPRET
@pytest.mark.interpret
@pytest.mark.parametrize("heads,splits", [(12, 3), (64, 2), (128, 4)])
def test_split_rows_merge_by_lse(heads, splits):
    """The top-k split over several programs and merged; one split of a row holds no valid slot."""
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    raw, pages = make_pages(fmt, 2, "cpu")
    q = make_queries(2, 1, heads, fmt, "cpu")
    idx = random_indices(2, 1, 128, 128, "cpu")
    idx[1, 0, :64] = -1                   # the first split(s) of row 1: nothing to attend
    idx[0, 0, 100:] = 10 ** 6             # past the pool: none
    ref = run(q, pages, idx, 0.05, "torch")
    got = launch(q, pages, idx, 0.05, fmt, None, {"splits": splits})
    assert_close_to_reference(*got, *ref)
    # the same settings with one split: the same rows, within rounding
    one = launch(q, pages, idx, 0.05, fmt, None, {"splits": 1})
    assert_close_to_reference(*one, *ref)


def _edge_case(device):
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    raw, pages = make_pages(fmt, 2, device)
    q = make_queries(3, 2, 12, fmt, device)
    idx = random_indices(3, 2, 70, 128, device).cpu()
    idx[0, 0] = -1                        # no valid slot at all
    idx[0, 1] = 128                       # only slots just past the pool: none either
    idx[1, 0, :69] = -1                   # one valid slot, at the very end
    idx[1, 1, 1::2] = -(2 ** 31)          # every other slot the most negative int32
    idx[2, 0, ::3] = 2 ** 31 - 1          # far past the pool
    return fmt, raw, pages, q, idx.to(device)


@pytest.mark.parametrize("impl", [pytest.param("torch"), pytest.param("triton", marks=[pytest.mark.interpret,
                                                                                        INTERPRET])])
def test_none_slots_anywhere_and_rows_without_any(impl):
    fmt, raw, pages, q, idx = _edge_case("cpu")
    before = raw.clone()
    out, lse = run(q, pages, idx, 0.05, impl)
    assert bool((out[0] == 0).all()) and bool(torch.isneginf(lse[0]).all())
    assert torch.isfinite(lse[1:]).all()
    ref = run(q, pages, idx, 0.05, "torch")
    assert_close_to_reference(out, lse, *ref)
    assert torch.equal(raw, before)


@pytest.mark.parametrize("impl", [pytest.param("torch"), pytest.param("triton", marks=[pytest.mark.interpret,
                                                                                        INTERPRET])])
def test_closed_forms(impl):
    """q = 0 gives a uniform softmax: out is the mean of the values (a repeated slot counts twice)
    and lse = ln(count); identical entries give out = that value and lse = score + ln(count)."""
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    raw, pages = make_pages(fmt, 2, "cpu")
    kv_c, _ = decode_entries(pages.reshape(128, -1), fmt)
    q = torch.zeros(1, 2, 16, 576, dtype=torch.bfloat16)
    idx = torch.full((1, 2, 64), -1, dtype=torch.int32)
    idx[0, 0, :64] = torch.arange(64)     # 64 distinct slots: weights 1/64, exact in bf16
    idx[0, 1, :3] = torch.tensor([5, 5, 9])
    out, lse = run(q, pages, idx, 0.1, impl)
    mean = kv_c[:64].mean(0)
    assert torch.allclose(out[0, 0].float(), mean.expand(16, -1), rtol=2 ** -7, atol=1e-3)
    want = (2 * kv_c[5] + kv_c[9]) / 3
    assert torch.allclose(out[0, 1].float(), want.expand(16, -1), rtol=2 ** -7, atol=1e-2)
    assert torch.allclose(lse[0, 0], torch.full((16,), math.log(64)), rtol=1e-5)
    assert torch.allclose(lse[0, 1], torch.full((16,), math.log(3)), rtol=1e-5)

    same = torch.randn(1, 512).expand(128, -1), torch.randn(1, 64).expand(128, -1)
    fill_pages(pages, fmt, latents=same)
    kv_c, k_pe = decode_entries(pages[0, 0], fmt)
    q = make_queries(1, 1, 12, fmt, "cpu")
    idx = torch.randint(0, 128, (1, 1, 50), dtype=torch.int32)
    out, lse = run(q, pages, idx, 0.05, impl)
    assert torch.allclose(out[0, 0].float(), kv_c.expand(12, -1), rtol=2 ** -7, atol=1e-3)
    score = q[0, 0].float() @ torch.cat([kv_c, k_pe]) * 0.05
    assert torch.allclose(lse[0, 0], score + math.log(50), rtol=1e-3, atol=1e-3)


@INTERPRET
@pytest.mark.interpret
def test_one_layer_of_a_packed_pool():
    """One layer's MLA pages of a packed K3.1 pool (page stride 1,210,368 B): every other byte of
    the pool is left as it was."""
    layout = plan(CacheConfig.from_model("kimi-k3.1"), num_rows=2)
    pool = CachePool(layout, device="cpu")
    pool.buffer.fill_(SENTINEL)
    pages = pool.mla_pages(layout.dsa_layers[7].layer)
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    assert pages.stride(0) == 1_210_368 and pages.shape[2] == 656
    fill_pages(pages, fmt)
    before = pool.buffer.clone()
    q = make_queries(2, 2, 12, fmt, "cpu")
    idx = random_indices(2, 2, 100, pages.shape[0] * 64, "cpu")
    ref = run(q, pages, idx, 576 ** -0.5, "torch")
    got = run(q, pages, idx, 576 ** -0.5, "triton")
    assert_close_to_reference(*got, *ref)
    assert torch.equal(pool.buffer, before)


@INTERPRET
@pytest.mark.interpret
def test_deterministic():
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    raw, pages = make_pages(fmt, 2, "cpu")
    q = make_queries(2, 1, 12, fmt, "cpu")
    idx = random_indices(2, 1, 96, 128, "cpu")
    first = launch(q, pages, idx, 0.05, fmt, None, {"splits": 2})
    second = launch(q, pages, idx, 0.05, fmt, None, {"splits": 2})
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_huge_page_stride_on_the_reference_path():
    """Page strides past 2**31 bytes (the buffer is allocated lazily: only two pages are touched)."""
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    stride = 2 ** 31 + 64 * 656
    raw = torch.empty(2 * stride, dtype=torch.uint8)
    pages = raw.as_strided((2, 64, 656), (stride, 656, 1))
    fill_pages(pages, fmt)
    q = make_queries(1, 1, 4, fmt, "cpu")
    idx = torch.tensor([[[3, 64 + 3]]], dtype=torch.int32)
    out, lse = sparse_mla_decode(q, pages, idx, 0.05)
    kv_c, k_pe = decode_entries(torch.stack([pages[0, 3], pages[1, 3]]), fmt)
    scores = q[0, 0].float() @ torch.cat([kv_c, k_pe], 1).T * 0.05
    assert torch.allclose(lse[0, 0], torch.logsumexp(scores, 1), rtol=1e-5)
    assert torch.allclose(out[0, 0].float(), torch.softmax(scores, 1) @ kv_c, rtol=1e-2, atol=1e-2)


def test_empty_batch():
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    raw, pages = make_pages(fmt, 1, "cpu")
    q = torch.zeros(0, 1, 12, 576, dtype=torch.bfloat16)
    for impl in ("torch", "auto"):
        out, lse = sparse_mla_decode(q, pages, torch.zeros(0, 1, 8, dtype=torch.int32), 0.1, impl=impl)
        assert out.shape == (0, 1, 12, 512) and lse.shape == (0, 1, 12)


def test_docstring_examples_run():
    import doctest

    from dsacache.ops.sparse_mla import api

    result = doctest.testmod(api, verbose=False)
    assert result.attempted >= 3 and result.failed == 0


# ---------------------------------------------------------------- refusals

def bad_calls():
    q = torch.zeros(2, 1, 12, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, 8, dtype=torch.int32)
    nan_out = torch.full((2, 1, 12, 512), float("nan"), dtype=torch.bfloat16)
    call = sparse_mla_decode
    return [
        ("q must be bfloat16", lambda p: call(q.float(), p, idx, 0.1)),
        ("q must be bfloat16", lambda p: call(q[0], p, idx, 0.1)),
        ("H=129 heads", lambda p: call(torch.zeros(2, 1, 129, 576, dtype=torch.bfloat16), p, idx, 0.1)),
        ("s_q=5", lambda p: call(torch.zeros(2, 5, 12, 576, dtype=torch.bfloat16), p, idx, 0.1)),
        ("below kv_lora_rank", lambda p: call(q[..., :500], p, idx, 0.1)),
        ("kv_lora_rank must be an integer", lambda p: call(q, p, idx, 0.1, kv_lora_rank=0)),
        ("match no entry kind", lambda p: call(q, p, idx, 0.1, kv_lora_rank=448)),
        ("do not hold bfloat16 entries", lambda p: call(q, p, idx, 0.1, kv_cache_dtype="bfloat16")),
        ("allowed: auto, bfloat16", lambda p: call(q, p, idx, 0.1, kv_cache_dtype="int4")),
        ("mla_pages must be a uint8 view", lambda p: call(q, p.view(torch.int8), idx, 0.1)),
        ("mla_pages must be a uint8 view", lambda p: call(q, p[:, :32], idx, 0.1)),
        ("indices must be int32", lambda p: call(q, p, idx.long(), 0.1)),
        ("indices must be int32", lambda p: call(q, p, idx[:1], 0.1)),
        ("topk=0", lambda p: call(q, p, idx[..., :0], 0.1)),
        ("topk=4097", lambda p: call(q, p, torch.zeros(2, 1, 4097, dtype=torch.int32), 0.1)),
        ("indices must be a torch.Tensor", lambda p: call(q, p, [[0]], 0.1)),
        ("softmax_scale must be a positive", lambda p: call(q, p, idx, 0.0)),
        ("softmax_scale must be a positive", lambda p: call(q, p, idx, float("nan"))),
        ("softmax_scale must be a positive", lambda p: call(q, p, idx, torch.tensor(0.1))),
        ("k_scale applies to kv_cache_dtype 'fp8' only", lambda p: call(q, p, idx, 0.1, k_scale=torch.ones(1))),
        ("out must be a contiguous", lambda p: call(q, p, idx, 0.1, out=nan_out[:, :, :, :256])),
        ("out must be a contiguous", lambda p: call(q, p, idx, 0.1, out=nan_out.float())),
        ("lse must be a contiguous", lambda p: call(q, p, idx, 0.1, out=nan_out, lse=torch.zeros(2, 1, 11))),
        ("impl", lambda p: call(q, p, idx, 0.1, out=nan_out, impl="cuda")),
    ], nan_out


def test_bad_input_raises_before_anything_runs():
    calls, nan_out = bad_calls()
    for message, bad in calls:
        raw, pages = make_pages(MlaEntryFormat.of("fp8_ds_mla", 512, 64), 2, "cpu")
        before = raw.clone()
        with pytest.raises(ValueError, match=message):
            bad(pages)
        assert torch.equal(raw, before), message
        assert bool(torch.isnan(nan_out).all()), message


def test_fp8_entries_need_a_positive_k_scale():
    fmt = MlaEntryFormat.of("fp8", 512, 64)
    raw, pages = make_pages(fmt, 1, "cpu", k_scale=torch.tensor([0.5]))
    q, idx = torch.zeros(1, 1, 4, 576, dtype=torch.bfloat16), torch.zeros(1, 1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs k_scale"):
        sparse_mla_decode(q, pages, idx, 0.1)
    with pytest.raises(ValueError, match="needs k_scale"):
        sparse_mla_decode(q, pages, idx, 0.1, k_scale=torch.tensor([0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="k_scale must be positive"):
        sparse_mla_decode(q, pages, idx, 0.1, k_scale=torch.tensor([-1.0]))


def test_split_choice():
    from dsacache.ops.sparse_mla.launch import choose_splits, head_block

    assert [head_block(h) for h in (1, 12, 16, 17, 32, 48, 64, 96, 128)] == [16, 16, 16, 32, 32, 64, 64, 64, 64]
    assert choose_splits(64, 1, 2048, 64, 132) == 2          # K3.1 at TP 8, B = 64: 64 rows fill half the SMs
    assert choose_splits(128, 1, 2048, 64, 132) == 1         # s_q = 2: 128 programs already
    assert choose_splits(256, 2, 2048, 32, 132) == 1         # B = 128, s_q = 2, H = 128
    assert choose_splits(4, 1, 2048, 64, 132) == 16          # a few long rows: the most splits
    assert choose_splits(64, 1, 2048, 64, None) == 1         # the interpreter


# ---------------------------------------------------------------- compiled for sm_90 (on any machine)

def test_kernels_compile_for_hopper_without_spills():
    """The kernels build for sm_90 at the launcher's settings for every entry kind and head block
    (ptxas ships with Triton) with no register spills; in a fresh interpreter, as this process
    runs Triton interpreted. Prints registers a thread."""
    pytest.importorskip("triton")
    script = PTXAS_USAGE + """
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from dsacache.formats.mla_entry import MlaEntryFormat
from dsacache.ops.sparse_mla import launch as L
from dsacache.ops.sparse_mla.merge_splits import merge_splits_kernel
from dsacache.ops.sparse_mla.sparse_attention import sparse_mla_attention_kernel

def build(kernel, signature, constants, aligned, options):
    names = list(kernel.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    signature = {**signature, **{k: "constexpr" for k in constants}}
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)

pointers = ["q_ptr", "pages_ptr", "idx_ptr", "k_scale_ptr", "out_ptr", "lse_ptr"]
strides = ["page_stride", "stride_qb", "stride_qs", "stride_qh", "stride_ib", "stride_is"]
# Every kind, head block and split at the default settings; the L2 prefetch sweep option on 656-B entries.
variants = [(kind, rope, bh, split, L.TRITON_PREFETCH) for kind, rope in (("fp8_ds_mla", 64), ("fp8_ds_mla", 0),
            ("bfloat16", 64), ("fp8", 64)) for bh in (16, 32, 64) for split in (False, True)]
variants += [("fp8_ds_mla", 64, bh, False, 2) for bh in (16, 32, 64)]
for kind, rope, bh, split, prefetch in variants:
    fmt = MlaEntryFormat.of(kind, 512, rope)
    cfg = {**L.triton_settings(bh, kind), "prefetch": prefetch}
    signature = dict(q_ptr="*bf16", pages_ptr="*u8", idx_ptr="*i32", k_scale_ptr="*fp32",
                     out_ptr="*fp32" if split else "*bf16", lse_ptr="*fp32")
    signature.update({n: "i32" for n in ["num_heads", "s_q", "topk", "keys_per_split", "num_splits",
                                         "num_slots"] + strides})
    signature["qk_scale"] = "fp32"
    compiled = build(sparse_mla_attention_kernel, signature, L.attention_constants(fmt, cfg, split),
                     pointers + strides, {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    regs, spilled, _ = usage(compiled)
    ptx = compiled.asm["ptx"]
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    assert mma == ("wgmma" if bh == 64 else "mma.sync"), (kind, bh, mma)
    assert "cp.async" in ptx, (kind, bh)
    print(f"{kind}-{fmt.entry_bytes} BH={bh} split={split} prefetch={prefetch} BLOCK_N={cfg['BLOCK_N']} "
          f"regs={regs} spilled={spilled} smem={compiled.metadata.shared} {mma}")
    assert spilled == 0, (kind, bh, split, spilled)
signature = dict(part_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32", num_heads="i32",
                 num_splits="i32")
compiled = build(merge_splits_kernel, signature, L.merge_constants(MlaEntryFormat.of("fp8_ds_mla", 512, 64)),
                 ["part_ptr", "part_lse_ptr", "out_ptr", "lse_ptr"], {"num_warps": L.MERGE_WARPS})
regs, spilled, _ = usage(compiled)
print(f"merge regs={regs} spilled={spilled}")
assert spilled == 0
print("built")
"""
    report = run_compiled_script(script)
    print(report)
    assert "built" in report


def test_gluon_kernels_compile_for_hopper_without_spills():
    """Both Gluon kernels build for sm_90 at the launcher's settings (one split and several; the 64-head
    kernel also at the sweep's 32-slot tiles), with wgmma (m64n16 for the 16-head kernel: slots as M,
    heads as N), their partitions' register budgets, no serialized wgmma (ptxas warns C7514 when it has
    to wait for each one), within the 227 KB of shared memory a block may take, and no spills beyond
    what ``spill_allowed`` names (bytes stored plus loaded): with its L2 prefetch on, the 64-head
    kernel spills two registers, one stored before the partitions split and one stored and loaded
    once a tile by the gatherer (measured faster than the spill-free setting without the prefetch;
    docs/benchmarks.md); in a fresh interpreter. Prints registers and shared memory."""
    pytest.importorskip("triton.experimental.gluon")
    script = PTXAS_USAGE + """
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from dsacache.ops.sparse_mla.decode_gluon import sparse_mla_decode_gluon_kernel
from dsacache.ops.sparse_mla.decode_gluon16 import sparse_mla_decode_gluon16_kernel
from dsacache.ops.sparse_mla.launch import GLUON_CONFIG, GLUON16_CONFIG

ALIGNED = ["q_ptr", "pages_ptr", "idx_ptr", "out_ptr", "lse_ptr", "page_stride", "stride_qb", "stride_qs",
           "stride_qh", "stride_ib", "stride_is"]

def build(kernel, split, constants, maxnreg, budgets, mma, spill_allowed=0):
    names = list(kernel.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    signature = dict(q_ptr="*bf16", pages_ptr="*u8", idx_ptr="*i32", out_ptr="*fp32" if split else "*bf16",
                     lse_ptr="*fp32")
    signature.update({n: "i32" for n in ["num_heads", "s_q", "topk", "keys_per_split", "num_splits", "num_slots",
                                         "page_stride", "stride_qb", "stride_qs", "stride_qh", "stride_ib",
                                         "stride_is"]})
    signature["qk_scale"] = "fp32"
    signature.update({k: "constexpr" for k in constants})
    compiled = triton.compile(GluonASTSource(kernel, signature, constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))
    ptx = compiled.asm["ptx"]
    _, spilled, report = usage(compiled)
    found = sorted(set(int(n) for n in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)))
    shared = compiled.metadata.shared
    print(f"{kernel.__name__} split={split} {constants}: {maxnreg} registers at entry, partition budgets {found}, "
          f"spilled={spilled}, smem={shared}")
    assert mma in ptx and spilled <= spill_allowed and shared <= 232448, (split, spilled, shared)
    assert "C7514" not in report, report
    assert set(budgets) <= set(found), (budgets, found)

for split, block_n, stages, l2_ahead in ((False, None, None, None), (True, None, None, None), (False, 32, 3, 0),
                                         (False, None, None, 0)):
    cfg = dict(GLUON_CONFIG, **({"BLOCK_N": block_n, "stages": stages} if block_n else {}))
    cfg["l2_ahead"] = cfg["l2_ahead"] if l2_ahead is None else l2_ahead
    constants = dict(SPLIT=split, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["stages"], L2_AHEAD=cfg["l2_ahead"],
                     GATHER_REGS=cfg["gather_regs"], VALUE_REGS=cfg["value_regs"])
    build(sparse_mla_decode_gluon_kernel, split, constants, cfg["maxnreg"], [cfg["gather_regs"], cfg["value_regs"]],
          "wgmma.mma_async", spill_allowed=16 if cfg["l2_ahead"] else 0)
for split, l2_ahead in ((False, True), (True, True), (False, False)):
    constants = dict(SPLIT=split, L2_AHEAD=l2_ahead, GATHER_REGS=GLUON16_CONFIG["gather_regs"])
    build(sparse_mla_decode_gluon16_kernel, split, constants, GLUON16_CONFIG["maxnreg"],
          [GLUON16_CONFIG["gather_regs"]], "wgmma.mma_async.sync.aligned.m64n16k16")
print("built")
"""
    report = run_compiled_script(script)
    print(report)
    assert "built" in report


# ---------------------------------------------------------------- GPU (compiled kernel, large shapes)

def _gpu_pool(num_pages, fmt, k_scale=None):
    """A layer's pages between another layer's (page stride 2 pages), random entries, sentinel around."""
    raw, pages = make_pages(fmt, num_pages, "cuda", page_stride=2 * 64 * fmt.entry_bytes, offset=4096,
                            k_scale=k_scale)
    return raw, pages


@functools.lru_cache(maxsize=1)
def _k31_gpu_pool():
    """2048 pages of 656-B entries between another layer's (172 MB): built once, only read."""
    return _gpu_pool(2048, MlaEntryFormat.of("fp8_ds_mla", 512, 64))


def _k31_gpu_case(batch, s_q, heads, topk):
    """A GPU case on the shared 656-B pool: ``topk`` random slots a row with -1 scattered, the first
    row empty, the last row's last 40 % past the pool; the fp32 reference of it."""
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    raw, pages = _k31_gpu_pool()
    q = make_queries(batch, s_q, heads, fmt, "cuda")
    idx = random_indices(batch, s_q, topk, 2048 * 64, "cuda", none_every=11)
    idx[0, 0] = -1
    idx[-1, -1, topk * 3 // 5:] = 2048 * 64 + 5
    return fmt, raw, raw.clone(), pages, q, idx, run(q, pages, idx, 576 ** -0.5, "torch")


@pytest.mark.gpu
@pytest.mark.parametrize("batch,s_q,heads", [(64, 1, 12), (64, 2, 12), (64, 1, 64), (64, 2, 64), (64, 1, 128),
                                             (16, 2, 128), (3, 4, 1), (5, 3, 24), (8, 1, 96)])
def test_gpu_matches_reference_k31_shapes(batch, s_q, heads):
    """656-B entries, top-k 2048 random slots with -1 scattered and some rows empty, in a strided
    pool; the launcher's own settings and split count, then forced 1 and 4 splits."""
    fmt, raw, before, pages, q, idx, ref = _k31_gpu_case(batch, s_q, heads, 2048)
    assert_close_to_reference(*run(q, pages, idx, 576 ** -0.5, "triton"), *ref)
    for splits in (1, 4):
        assert_close_to_reference(*launch(q, pages, idx, 576 ** -0.5, fmt, None, {"splits": splits}), *ref)
    assert torch.equal(raw, before)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,rank,rope", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("heads", [12, 32, 64, 128])
def test_gpu_every_kind(kind, rank, rope, heads):
    fmt = MlaEntryFormat.of(kind, rank, rope)
    k_scale = k_scale_for(kind, "cuda")
    raw, pages = _gpu_pool(256, fmt, k_scale)
    q = make_queries(16, 2, heads, fmt, "cuda")
    idx = random_indices(16, 2, 1000, 256 * 64, "cuda")
    ref = run(q, pages, idx, fmt.cached_dim ** -0.5, "torch", k_scale=k_scale)
    assert_close_to_reference(*run(q, pages, idx, fmt.cached_dim ** -0.5, "triton", k_scale=k_scale), *ref)


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [1, 63, 65, 4096])
def test_gpu_topk_edges_and_closed_form(topk):
    fmt, raw, pages, q, idx = _edge_case("cuda")
    ref = run(q, pages, idx, 0.05, "torch")
    assert_close_to_reference(*run(q, pages, idx, 0.05, "triton"), *ref)
    _, pages = _gpu_pool(128, fmt)
    q = make_queries(4, 1, 12, fmt, "cuda")
    idx = random_indices(4, 1, topk, 128 * 64, "cuda", none_every=3)
    ref = run(q, pages, idx, 0.05, "torch")
    assert_close_to_reference(*run(q, pages, idx, 0.05, "triton"), *ref)
    q = torch.zeros(1, 1, 12, 576, dtype=torch.bfloat16, device="cuda")
    idx = torch.arange(64, dtype=torch.int32, device="cuda").view(1, 1, 64)
    out, lse = run(q, pages, idx, 0.1, "triton")
    mean = decode_entries(pages[0], fmt)[0].mean(0)
    assert torch.allclose(out[0, 0].float(), mean.expand(12, -1), rtol=2 ** -7, atol=1e-3)
    assert torch.allclose(lse[0, 0], torch.full_like(lse[0, 0], math.log(64)), rtol=1e-5)


@pytest.mark.gpu
def test_gpu_one_layer_of_a_packed_pool():
    layout = plan(CacheConfig.from_model("kimi-k3.1"), num_rows=64)
    pool = CachePool(layout, device="cuda")
    pool.buffer.fill_(SENTINEL)
    pages = pool.mla_pages(layout.dsa_layers[23].layer)
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    fill_pages(pages, fmt)
    before = pool.buffer.clone()
    q = make_queries(32, 2, 12, fmt, "cuda")
    idx = random_indices(32, 2, 2048, pages.shape[0] * 64, "cuda")
    ref = run(q, pages, idx, 576 ** -0.5, "torch")
    assert_close_to_reference(*run(q, pages, idx, 576 ** -0.5, "triton"), *ref)
    assert torch.equal(pool.buffer, before)


@pytest.mark.gpu
def test_gpu_page_stride_past_2_31():
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    stride = 2 ** 31 + 64 * 656 * 3
    raw = torch.full((2 * stride,), SENTINEL, dtype=torch.uint8, device="cuda")
    pages = raw.as_strided((2, 64, 656), (stride, 656, 1))
    fill_pages(pages, fmt)
    q = make_queries(2, 1, 12, fmt, "cuda")
    idx = random_indices(2, 1, 100, 128, "cuda")
    ref = run(q, pages, idx, 0.05, "torch")
    assert_close_to_reference(*run(q, pages, idx, 0.05, "triton"), *ref)


@pytest.mark.gpu
def test_gpu_deterministic_and_capturable_in_a_cuda_graph():
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    raw, pages = _gpu_pool(1024, fmt)
    q = make_queries(64, 1, 12, fmt, "cuda")
    idx = random_indices(64, 1, 2048, 1024 * 64, "cuda")
    out = torch.empty(64, 1, 12, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(64, 1, 12, device="cuda")
    first = [t.clone() for t in sparse_mla_decode(q, pages, idx, 0.05, out=out, lse=lse)]
    again = sparse_mla_decode(q, pages, idx, 0.05)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla_decode(q, pages, idx, 0.05, out=out, lse=lse)
    out.fill_(float("nan"))
    idx.copy_(random_indices(64, 1, 2048, 1024 * 64, "cuda", seed=9))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_reference(out, lse, *run(q, pages, idx, 0.05, "torch"))


@INTERPRET
@pytest.mark.interpret
def test_rank_past_512_is_not_implemented_on_the_triton_path():
    fmt = MlaEntryFormat.of("bfloat16", 640, 0)
    raw, pages = make_pages(fmt, 1, "cpu")
    q = torch.zeros(1, 1, 4, 640, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, 4, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="kv_lora_rank <= 512"):
        sparse_mla_decode(q, pages, idx, 0.1, kv_lora_rank=640, impl="triton")
    out, lse = sparse_mla_decode(q, pages, idx, 0.1, kv_lora_rank=640, impl="torch")
    assert out.shape == (1, 1, 4, 640)


def require_hopper():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon sparse MLA decode is for Hopper (sm_90)")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [{}, {"splits": 3}, {"BLOCK_N": 32, "stages": 3},
                                    {"BLOCK_N": 32, "stages": 3, "splits": 2}, {"l2_ahead": 0}, {"l2_ahead": 1}])
@pytest.mark.parametrize("batch,s_q,heads", [(8, 2, 12), (8, 1, 40), (8, 2, 64), (4, 1, 128)])
def test_gpu_gluon_kernel_matches_reference(config, batch, s_q, heads):
    """The Gluon kernel forced, against the reference: -1 scattered, a row with none, slots past the
    pool, a partial last tile (top-k 1000), padded heads (12 and 40 of 64), two head blocks, splits;
    the pool untouched."""
    require_hopper()
    fmt, raw, before, pages, q, idx, ref = _k31_gpu_case(batch, s_q, heads, 1000)
    assert_close_to_reference(*launch(q, pages, idx, 576 ** -0.5, fmt, None, {"kernel": "gluon", **config}), *ref)
    assert torch.equal(raw, before)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [{}, {"splits": 1}, {"splits": 3}, {"splits": 16}, {"l2_ahead": 0}])
@pytest.mark.parametrize("batch,s_q,heads,topk", [(8, 2, 12, 1000), (8, 1, 16, 1000), (3, 4, 1, 1000),
                                                  (5, 1, 7, 65), (2, 1, 12, 63), (64, 1, 12, 2048)])
def test_gpu_gluon16_kernel_matches_reference(config, batch, s_q, heads, topk):
    """The 16-head Gluon kernel forced, against the reference: -1 scattered, a row with none, slots past
    the pool, partial last tiles (top-k 1000, 65, 63: one tile for only one of the two gatherers), 1, 7,
    12 and 16 heads, splits (16: some of one tile or none), with and without the L2 look-ahead; the pool
    untouched."""
    require_hopper()
    fmt, raw, before, pages, q, idx, ref = _k31_gpu_case(batch, s_q, heads, topk)
    assert_close_to_reference(*launch(q, pages, idx, 576 ** -0.5, fmt, None, {"kernel": "gluon16", **config}),
                              *ref)
    assert torch.equal(raw, before)


@pytest.mark.gpu
def test_gpu_gluon16_kernel_keeps_keys_exact():
    """The 16-head kernel scales scores by the tile scales in fp32 (keys never rounded): its LSE is as
    close to the fp64 reference as fp32 sums allow, far inside the 1e-3 bound, even where tile scales
    differ widely between slots."""
    require_hopper()
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    gen = torch.Generator().manual_seed(5)
    kv_c = torch.randn(64 * 64, 512, generator=gen) * torch.logspace(-3, 3, 64 * 64).view(-1, 1)
    raw, pages = make_pages(fmt, 64, "cuda", latents=(kv_c, torch.randn(64 * 64, 64, generator=gen)))
    q = make_queries(4, 1, 12, fmt, "cuda") * 1e-2
    idx = random_indices(4, 1, 2048, 64 * 64, "cuda")
    ref_out, ref_lse = run(q, pages, idx, 576 ** -0.5, "torch")
    out, lse = launch(q, pages, idx, 576 ** -0.5, fmt, None, {"kernel": "gluon16"})
    assert_close_to_reference(out, lse, ref_out, ref_lse)
    live = torch.isfinite(ref_lse)
    assert float(((lse - ref_lse)[live].abs() / ref_lse[live].abs().clamp_min(1.0)).max()) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [64, 128])
def test_gpu_triton_kernel_where_gluon_is_the_default(heads):
    """The Triton kernel forced at 64 and 128 heads on 656-B entries (Hopper runs Gluon there by default)."""
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    raw, pages = _k31_gpu_pool()
    q = make_queries(32, 2, heads, fmt, "cuda")
    idx = random_indices(32, 2, 2048, 2048 * 64, "cuda")
    ref = run(q, pages, idx, 576 ** -0.5, "torch")
    assert_close_to_reference(*launch(q, pages, idx, 576 ** -0.5, fmt, None, {"kernel": "triton"}), *ref)


@pytest.mark.gpu
def test_gpu_kernel_choice():
    from dsacache.ops.sparse_mla.launch import decode_kernel

    require_hopper()
    ds_mla = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    _, pages = _k31_gpu_pool()
    q12, q40, q128 = (make_queries(1, 1, h, ds_mla, "cuda") for h in (12, 40, 128))
    q24 = make_queries(1, 1, 24, ds_mla, "cuda")
    assert [decode_kernel(q, pages, ds_mla) for q in (q12, q24, q40, q128)] == ["gluon16", "triton", "gluon", "gluon"]
    assert decode_kernel(q12, pages, ds_mla, {"kernel": "gluon"}) == "gluon"
    assert decode_kernel(q12, pages, ds_mla, {"kernel": "triton"}) == "triton"
    with pytest.raises(ValueError, match="at most 16 heads"):
        decode_kernel(q24, pages, ds_mla, {"kernel": "gluon16"})
    assert decode_kernel(q128, pages, ds_mla, {"kernel": "triton"}) == "triton"
    bf16 = MlaEntryFormat.of("bfloat16", 512, 64)
    _, bf16_pages = _gpu_pool(1, bf16)
    assert decode_kernel(make_queries(1, 1, 64, bf16, "cuda"), bf16_pages, bf16) == "triton"
    assert decode_kernel(make_queries(1, 1, 12, bf16, "cuda"), bf16_pages, bf16) == "triton"
    for kernel in ("gluon", "gluon16"):
        with pytest.raises(ValueError, match="Gluon"):
            decode_kernel(make_queries(1, 1, 12, bf16, "cuda"), bf16_pages, bf16, {"kernel": kernel})


@pytest.mark.gpu
@pytest.mark.parametrize("heads,prefetch", [(12, 2), (12, 4), (64, 2)])
def test_gpu_triton_kernel_with_l2_prefetch(heads, prefetch):
    """The Triton kernel's L2 prefetch sweep option: the same results (it only warms L2)."""
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    raw, pages = _k31_gpu_pool()
    q = make_queries(64, 1, heads, fmt, "cuda")
    idx = random_indices(64, 1, 2048, 2048 * 64, "cuda", none_every=5)
    ref = run(q, pages, idx, 576 ** -0.5, "torch")
    got = launch(q, pages, idx, 576 ** -0.5, fmt, None, {"kernel": "triton", "prefetch": prefetch})
    assert_close_to_reference(*got, *ref)
