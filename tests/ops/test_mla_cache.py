"""MLA latent store: both paths against the reference codecs, the bytes FlashMLA reads, sentinels, refusals."""

import pytest
import torch

from dsacache import CacheConfig, plan
from dsacache.formats.mla_entry import MlaEntryFormat, decode_entries, encode_entries
from dsacache.ops.mla_cache import store_mla_latents
from dsacache.runtime import CachePool
from tests.helpers import triton_available

SENTINEL = 0xA5

PATHS = [pytest.param("cpu", "torch", id="torch")]
if triton_available():
    PATHS += [pytest.param("cpu", "triton", id="triton-interpret", marks=pytest.mark.interpret),
              pytest.param("cuda", "triton", id="triton-gpu", marks=pytest.mark.gpu)]


def _pages(num_pages, entry, device, page_stride=None, offset=0):
    """A sentinel-filled buffer and a paged view into it (a layer's pages inside wider sub-rows)."""
    stride = page_stride or 64 * entry
    raw = torch.full((num_pages * stride + offset,), SENTINEL, dtype=torch.uint8, device=device)
    return raw, raw.as_strided((num_pages, 64, entry), (stride, entry, 1), offset)


def _expected(raw, pages, kv_c, k_pe, slots, fmt, k_scale):
    """The raw buffer after a store, from the reference codecs alone."""
    out = raw.clone()
    view = out.as_strided(pages.shape, pages.stride(), pages.storage_offset())
    entries = encode_entries(kv_c.cpu(), None if k_pe is None else k_pe.cpu(), fmt,
                             None if k_scale is None else k_scale.cpu())
    for t, slot in enumerate(slots.tolist()):
        if 0 <= slot < pages.shape[0] * 64:
            view[slot // 64, slot % 64] = entries[t].to(view.device)
    return out


def _check_bytes(got, want, fmt):
    """Equal but for e4m3 rounding: at most one code step on under 1 % of the value bytes (casts differ)."""
    diff = got.long() - want.long()
    assert int(diff.abs().max()) <= 1, fmt
    assert float((diff != 0).float().mean()) < 0.01, fmt


@pytest.mark.parametrize("device,impl", PATHS)
@pytest.mark.parametrize("dtype,rank,rope", [("fp8_ds_mla", 512, 64), ("fp8_ds_mla", 512, 0),
                                             ("bfloat16", 512, 64), ("fp8", 512, 64), ("fp8_ds_mla", 384, 32)])
@pytest.mark.parametrize("num_tokens", [1, 63, 65])
def test_store_matches_the_reference(device, impl, dtype, rank, rope, num_tokens):
    torch.manual_seed(num_tokens)
    fmt = MlaEntryFormat.of(dtype, rank, rope)
    raw, pages = _pages(3, fmt.entry_bytes, device, page_stride=64 * fmt.entry_bytes + 4096, offset=1024)
    kv_c = torch.randn(num_tokens, rank, device=device, dtype=torch.bfloat16) * 3
    k_pe = torch.randn(num_tokens, rope, device=device, dtype=torch.bfloat16) if rope else None
    slots = torch.randperm(3 * 64, device=device)[:num_tokens]
    slots[::5] = -1
    k_scale = torch.tensor([0.05], device=device) if dtype == "fp8" else None
    want = _expected(raw, pages, kv_c, k_pe, slots, fmt, k_scale)
    store_mla_latents(kv_c, k_pe, pages, slots, impl=impl, k_scale=k_scale)
    _check_bytes(raw.cpu(), want.cpu(), fmt)


@pytest.mark.parametrize("device,impl", PATHS)
def test_ds_mla_scales_and_rope_are_exact(device, impl):
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    raw, pages = _pages(2, 656, device)
    kv_c = torch.randn(5, 512, device=device)
    k_pe = torch.randn(5, 64, device=device).bfloat16()
    slots = torch.tensor([3, 70, -1, 0, 127], device=device)
    store_mla_latents(kv_c, k_pe, pages, slots, "fp8_ds_mla", impl=impl)
    entries = encode_entries(kv_c.cpu(), k_pe.cpu(), fmt)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        got = pages[slot // 64, slot % 64].cpu()
        assert torch.equal(got[512:], entries[t, 512:])  # fp32 tile scales and bf16 rope bytes: exact
        back_c, back_pe = decode_entries(got, fmt)
        assert torch.allclose(back_c, kv_c[t].cpu(), rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("device,impl", PATHS)
def test_packed_pool_writes_only_the_slots_asked_for(device, impl):
    layout = plan(CacheConfig.from_model("kimi-k3.1"), num_rows=2)
    pool = CachePool(layout, device=device)
    pool.buffer.fill_(SENTINEL)
    layer = layout.dsa_layers[5].layer
    pages = pool.mla_pages(layer)
    assert pages.stride(0) == 1_210_368 and pages.shape[2] == 656
    slots = torch.tensor([0, 64 * 17 + 5, -1, pages.shape[0] * 64 - 1], device=device)
    kv_c, k_pe = torch.randn(4, 512, device=device), torch.randn(4, 64, device=device)
    before = pool.buffer.clone()
    store_mla_latents(kv_c, k_pe, pages, slots, impl=impl)
    changed = (pool.buffer != before).nonzero().squeeze(1).cpu()
    owned = set()
    base = pages.storage_offset() - pool.buffer.storage_offset()  # the KDA guard row comes first
    for slot in (0, 64 * 17 + 5, pages.shape[0] * 64 - 1):
        start = base + (slot // 64) * pages.stride(0) + (slot % 64) * 656
        owned.update(range(start, start + 656))
    assert set(changed.tolist()) <= owned and len(changed) > 0


def test_flashmla_reading_order():
    """The bytes a FlashMLA-style reader takes from a [P, 64, 1, 656] view: values, 4 fp32 scales, bf16 rope."""
    raw, pages = _pages(1, 656, "cpu")
    kv_c = torch.zeros(1, 512)
    kv_c[0, 128:256] = 2.0
    store_mla_latents(kv_c, torch.ones(1, 64), pages, torch.tensor([7]), impl="torch")
    view = pages.unsqueeze(2)
    assert view.shape == (1, 64, 1, 656) and view.stride(1) == 656
    entry = view[0, 7, 0]
    assert entry[512:528].view(torch.float32).tolist() == pytest.approx([1e-4 / 448, 2 / 448, 1e-4 / 448, 1e-4 / 448])
    assert entry[128:256].eq(0x7E).all()  # 2 / (2 / 448) = 448
    assert entry[528:].view(torch.bfloat16).eq(1).all()


def test_repeated_slot_keeps_the_last_token_on_the_reference_path():
    raw, pages = _pages(1, 1152, "cpu")
    kv_c = torch.stack([torch.full((512,), 1.0), torch.full((512,), 2.0)])
    store_mla_latents(kv_c, torch.zeros(2, 64), pages, torch.tensor([4, 4]), impl="torch")
    assert pages[0, 4, :1024].view(torch.bfloat16).eq(2).all()


def bad_calls():
    kv_c, k_pe = torch.randn(4, 512), torch.randn(4, 64)
    slots = torch.arange(4)
    return [
        ("kv_c must be a 2-D tensor", lambda p: store_mla_latents(kv_c[0], k_pe, p, slots)),
        ("kv_c.dtype", lambda p: store_mla_latents(kv_c.int(), k_pe, p, slots)),
        ("k_pe has 3 tokens", lambda p: store_mla_latents(kv_c, k_pe[:3], p, slots)),
        ("match no entry kind", lambda p: store_mla_latents(kv_c, None, p, slots)),
        ("do not hold bfloat16 entries", lambda p: store_mla_latents(kv_c, k_pe, p, slots, "bfloat16")),
        ("allowed: auto, bfloat16", lambda p: store_mla_latents(kv_c, k_pe, p, slots, "int8")),
        ("slot_mapping has 3 entries", lambda p: store_mla_latents(kv_c, k_pe, p, slots[:3])),
        ("slot_mapping values", lambda p: store_mla_latents(kv_c, k_pe, p, torch.tensor([0, 1, 2, 128]))),
        ("slot_mapping values", lambda p: store_mla_latents(kv_c, k_pe, p, torch.tensor([0, -2, 1, 2]))),
        ("1-D int32 or int64", lambda p: store_mla_latents(kv_c, k_pe, p, slots.float())),
        ("slot_mapping must be a torch.Tensor", lambda p: store_mla_latents(kv_c, k_pe, p, [0, 1, 2, 3])),
        ("k_scale applies to kv_cache_dtype 'fp8' only", lambda p: store_mla_latents(
            kv_c, k_pe, p, slots, k_scale=torch.tensor([1.0]))),
        ("check_slots must be True or False", lambda p: store_mla_latents(kv_c, k_pe, p, slots, check_slots=1)),
        ("impl", lambda p: store_mla_latents(kv_c, k_pe, p, slots, impl="cuda")),
    ]


def test_bad_input_raises_and_writes_nothing():
    for message, call in bad_calls():
        raw, pages = _pages(2, 656, "cpu")
        with pytest.raises(ValueError, match=message):
            call(pages)
        assert bool((raw == SENTINEL).all()), message


def test_fp8_needs_a_positive_k_scale():
    raw, pages = _pages(1, 576, "cpu")
    kv_c, k_pe, slots = torch.randn(2, 512), torch.randn(2, 64), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="needs k_scale"):
        store_mla_latents(kv_c, k_pe, pages, slots)
    with pytest.raises(ValueError, match="k_scale must be positive"):
        store_mla_latents(kv_c, k_pe, pages, slots, k_scale=torch.tensor([0.0]))
    assert bool((raw == SENTINEL).all())


@pytest.mark.gpu
def test_store_is_capturable_in_a_cuda_graph():
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 64)
    raw, pages = _pages(4, 656, "cuda")
    kv_c, k_pe = torch.randn(64, 512, device="cuda"), torch.randn(64, 64, device="cuda")
    slots = torch.randperm(256, device="cuda")[:64]
    store_mla_latents(kv_c, k_pe, pages, slots, check_slots=False)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_mla_latents(kv_c, k_pe, pages, slots, check_slots=False)
    raw.fill_(SENTINEL)
    kv_c.copy_(torch.randn_like(kv_c))
    graph.replay()
    torch.cuda.synchronize()
    _check_bytes(raw.cpu(), _expected(torch.full_like(raw, SENTINEL), pages, kv_c, k_pe, slots, fmt, None).cpu(), fmt)
