"""Indexer key cache write path: Triton against the PyTorch reference, byte layout, edge cases.

On CPU the Triton kernels run under the interpreter (``impl="triton"``) at small sizes;
the ``cuda`` cases (marked ``gpu``) run the same checks on the device at larger sizes.
Every pool is a packed multi-layer pool pre-filled with a sentinel: each test checks
that the bytes no written slot owns are still the sentinel afterwards.
"""

import math
import struct

import pytest
import torch
import torch.nn.functional as F

from dsacache.formats.indexer_key import quantize_fp8, quantize_mxfp4
from dsacache.formats.key_format import IndexerKeyFormat
from dsacache.ops.indexer_k_cache import (
    dequantize_indexer_keys,
    fused_norm_store_indexer_keys,
    gather_indexer_keys,
    store_indexer_keys,
)
from dsacache.ops.indexer_k_cache import naive
from tests.helpers import rel_rms_error, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton (or its interpreter)")

SENTINEL = 0xA5
PAGE = 64
MLA_BYTES = 16    # a stand-in MLA entry beside each layer's indexer page
NUM_LAYERS = 3
LAYER = 1         # the layer under test; layers 0 and 2 must stay untouched
# "cpu" runs the Triton kernels under the interpreter (CI); "cuda" runs them on the device.
DEVICES = [pytest.param("cpu", marks=pytest.mark.interpret), pytest.param("cuda", marks=pytest.mark.gpu)]
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def entry_bytes(fmt, head_dim):
    return head_dim + 4 if fmt == "fp8" else head_dim // 2 + head_dim // 32


class PackedPool:
    """A flat byte pool of ``num_pages`` sub-rows, each holding every layer's MLA and indexer page.

    A few extra pages at the end stand for state rows: no slot ever points into them.
    """

    def __init__(self, fmt, head_dim, num_pages, device, extra_pages=2):
        self.fmt, self.head_dim, self.num_pages = fmt, head_dim, num_pages
        self.entry = entry_bytes(fmt, head_dim)
        self.page_stride = NUM_LAYERS * PAGE * (MLA_BYTES + self.entry)
        self.offset = LAYER * PAGE * (MLA_BYTES + self.entry) + PAGE * MLA_BYTES
        total = (num_pages + extra_pages) * self.page_stride
        self.raw = torch.full((total,), SENTINEL, dtype=torch.uint8, device=device)

    @property
    def pages(self):
        return self.raw.as_strided((self.num_pages, PAGE, self.entry), (self.page_stride, self.entry, 1), self.offset)

    def value_scale_bytes(self):
        if self.fmt == "fp8":
            return self.head_dim, 4
        return self.head_dim // 2, self.head_dim // 32

    def owned_mask(self, slots):
        """Bytes of the raw pool that the given slots' entries own (the layout of docs/layout.md)."""
        mask = torch.zeros(self.raw.shape, dtype=torch.bool)
        vb, sb = self.value_scale_bytes()
        slots = torch.as_tensor(slots).cpu().long()
        slots = slots[slots >= 0].view(-1, 1)
        base = self.offset + (slots // PAGE) * self.page_stride
        row = slots % PAGE
        mask[base + row * vb + torch.arange(vb)] = True
        mask[base + PAGE * vb + row * sb + torch.arange(sb)] = True
        return mask

    def assert_only_slots_written(self, slots):
        raw = self.raw.cpu()
        untouched = raw[~self.owned_mask(slots)]
        changed = int((untouched != SENTINEL).sum())
        assert changed == 0, f"{changed} bytes outside the slots changed"

    def entries(self, slots):
        """(value bytes ``[n, vb]``, scale bytes ``[n, sb]``) of slots, read from the raw pool by
        the layout of docs/layout.md alone."""
        raw = self.raw.cpu()
        vb, sb = self.value_scale_bytes()
        slots = torch.as_tensor(slots).cpu().long().view(-1, 1)
        base = self.offset + (slots // PAGE) * self.page_stride
        row = slots % PAGE
        return raw[base + row * vb + torch.arange(vb)], raw[base + PAGE * vb + row * sb + torch.arange(sb)]

    def raw_entry(self, slot):
        values, scales = self.entries([slot])
        return values[0], scales[0]

    def decode_raw(self, slot):
        """fp32 key stored at ``slot``, decoded by hand from its raw bytes."""
        values, scales = self.raw_entry(slot)
        if self.fmt == "fp8":
            (scale,) = struct.unpack("<f", bytes(scales.tolist()))
            return values.view(torch.float8_e4m3fn).float() * scale
        out = []
        for i, byte in enumerate(values.tolist()):
            for code in (byte & 0xF, byte >> 4):
                magnitude = E2M1[code & 7] * 2.0 ** (scales[(2 * i) // 32].item() - 127)
                out.append(-magnitude if code & 8 else magnitude)
        return torch.tensor(out)


def impl_for(device):
    return "triton" if device == "cpu" else "auto"


def random_slots(num_tokens, num_pages, device, num_skipped=0):
    slots = torch.randperm(num_pages * PAGE)[:num_tokens]
    if num_skipped:
        slots[torch.randperm(num_tokens)[:num_skipped]] = -1
    return slots.to(device)


def random_keys(num_tokens, head_dim, dtype, device):
    """Keys with per-token magnitudes over six decades, so scales vary."""
    magnitude = 10.0 ** torch.empty(num_tokens, 1).uniform_(-3, 3)
    return (torch.randn(num_tokens, head_dim) * magnitude).to(dtype).to(device)


def e4m3_code_distance(a, b):
    """Distance in representable steps between e4m3 codes (uint8 tensors of the same shape)."""
    def ordinal(c):
        c = c.cpu().int()
        return torch.where(c >= 128, -(c - 128), c)

    return (ordinal(a) - ordinal(b)).abs()


def assert_fp8_close(pool_a, pool_b, slots):
    """Scales bit-identical; values within one code step on under 1% of entries."""
    valid = slots[slots >= 0]
    values_a, scales_a = pool_a.entries(valid)
    values_b, scales_b = pool_b.entries(valid)
    assert torch.equal(scales_a, scales_b)
    dist = e4m3_code_distance(values_a, values_b)
    assert int(dist.max()) <= 1
    assert float((dist > 0).float().mean()) < 0.01


def store_both(fmt, num_tokens, head_dim, dtype, device, num_pages, store, num_skipped=0):
    """Run ``store(k, pages, slots, impl)`` with Triton and with the reference on twin pools."""
    k = random_keys(num_tokens, head_dim, dtype, device)
    slots = random_slots(num_tokens, num_pages, device, num_skipped)
    pools = {}
    for impl in (impl_for(device), "torch"):
        pools[impl] = PackedPool(fmt, head_dim, num_pages, device)
        store(k, pools[impl].pages, slots, impl)
    return k, slots, pools[impl_for(device)], pools["torch"]


# ---- plain FP8 store ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens,dtype", [(1, torch.bfloat16), (63, torch.float16),
                                              (64, torch.float32), (65, torch.bfloat16)])
def test_store_fp8_matches_reference(device, num_tokens, dtype):
    num_tokens *= 1 if device == "cpu" else 128
    num_pages = max(2, 2 * num_tokens // PAGE)

    def store(k, pages, slots, impl):
        store_indexer_keys(k, pages, slots, "fp8", impl=impl)

    _, slots, tri, ref = store_both("fp8", num_tokens, 128, dtype, device, num_pages, store,
                                    num_skipped=num_tokens // 8)
    assert_fp8_close(tri, ref, slots)
    tri.assert_only_slots_written(slots)
    ref.assert_only_slots_written(slots)


@pytest.mark.parametrize("device", DEVICES)
def test_store_fp8_packed_pool_page_stride(device):
    """A K3.1-sized page stride (24 layers): the other layers' bytes stay untouched."""
    page_stride, layer_offset, num_pages = 1_210_368, 5 * 64 * 788 + 64 * 656, 3
    raw = torch.full((num_pages * page_stride,), SENTINEL, dtype=torch.uint8, device=device)
    pages = raw.as_strided((num_pages, PAGE, 132), (page_stride, 132, 1), layer_offset)
    k = random_keys(40, 128, torch.bfloat16, device)
    slots = torch.randperm(num_pages * PAGE)[:40].to(device)
    store_indexer_keys(k, pages, slots, impl=impl_for(device))
    expected = torch.full_like(raw, SENTINEL)
    expected_pages = expected.as_strided(pages.shape, pages.stride(), layer_offset)
    store_indexer_keys(k, expected_pages, slots, impl="torch")
    changed = raw != expected
    assert int(changed.sum()) <= 0.01 * 40 * 128


# ---- fused LayerNorm store -----------------------------------------------------------

def assert_fused_close(fmt, pool_a, pool_b, slots):
    """The fused tolerance: FP8 as :func:`assert_fp8_close`; MXFP4 bytes differ on under 0.1 % of
    the entries' bytes (LayerNorm last bits move a code where a value sits on a rounding boundary)."""
    if fmt == "fp8":
        assert_fp8_close(pool_a, pool_b, slots)
        return
    valid = slots[slots >= 0]
    a, b = torch.cat(pool_a.entries(valid), dim=1), torch.cat(pool_b.entries(valid), dim=1)
    assert float((a != b).float().mean()) < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("num_tokens", [1, 65])
def test_fused_store_matches_reference(device, fmt, num_tokens):
    """Random LayerNorm parameters: the two LayerNorms differ in the last bit, so rare flips."""
    num_tokens *= 1 if device == "cpu" else 128
    weight = torch.randn(128, device=device)
    bias = torch.randn(128, device=device) * 0.1

    def store(k, pages, slots, impl):
        fused_norm_store_indexer_keys(k, weight, bias, pages, slots, fmt, impl=impl)

    k, slots, tri, ref = store_both(fmt, num_tokens, 128, torch.bfloat16, device,
                                    max(2, 2 * num_tokens // PAGE), store, num_skipped=num_tokens // 8)
    assert_fused_close(fmt, tri, ref, slots)
    tri.assert_only_slots_written(slots)
    ref.assert_only_slots_written(slots)
    for s in slots[:4].tolist():
        if s >= 0:
            t = int((slots == s).nonzero()[0])
            expected = naive.layer_norm(k[t].cpu(), weight.cpu(), bias.cpu(), 1e-6)
            assert rel_rms_error(tri.decode_raw(s), expected) < (0.07 if fmt == "fp8" else 0.2)


def conditioned_keys(num_tokens, head_dim, device):
    """fp32 keys, 8 tokens a cycle: token 0 has a mean 1000 standard deviations off zero (the raw
    variance E[x**2] - mean**2 would cancel), tokens 2 and 3 a mean 3 standard deviations off (just
    inside the raw moments' guard), token 5 an element of 3e20 (its square is past fp32), the others
    are random keys over six decades of magnitude. Tokens 0, 2 and 3 are integers times a power of
    two with a row sum that ``head_dim`` divides, so their mean and centred values are exact in fp32
    whatever the order of the sums: a 1000-sigma offset would otherwise make outputs near zero move
    by a few codes with the order alone."""
    k = random_keys(num_tokens, head_dim, torch.float32, "cpu")
    cycle = torch.arange(num_tokens) % 8
    grid = torch.randint(-64, 65, (num_tokens, head_dim)).float()
    grid[:, 0] -= torch.remainder(grid.sum(dim=1), head_dim)
    sigmas = torch.where(cycle == 0, 1000.0, 3.0)[:, None]
    grid += (sigmas * grid.std(dim=1, keepdim=True)).round()
    grid *= 2.0 ** torch.randint(-10, 11, (num_tokens, 1)).float()
    offset = (cycle == 0) | (cycle == 2) | (cycle == 3)
    k[offset] = grid[offset]
    k[cycle == 5, 9] = 3.0e20
    return k.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("num_tokens,head_dim", [(1, 128), (8, 96), (64, 128)])
def test_fused_small_batch_moments_guard(device, fmt, num_tokens, head_dim):
    """Small batches (programs of 2 tokens) take the LayerNorm's mean and variance from raw moments;
    a program with a token they cannot serve (tokens 0 and 5 of each 8 here) takes the exact
    two-pass statistics for both its tokens, the others (tokens 2, 3 and 6, 7) keep the raw ones,
    near the guard's bound or not. Every token, its neighbours included, stores the reference's
    bytes within the fused tolerance; without the guard token 0's raw variance is typically ~10 % off."""
    launch = launch_module()
    k = conditioned_keys(num_tokens, head_dim, device)
    weight, bias = torch.randn(head_dim, device=device), torch.randn(head_dim, device=device) * 0.1
    slots = random_slots(num_tokens, 2, device, num_skipped=num_tokens // 8)
    pools = {}
    for impl in (impl_for(device), "torch"):
        pools[impl] = PackedPool(fmt, head_dim, 2, device)
        fused_norm_store_indexer_keys(k, weight, bias, pools[impl].pages, slots, fmt, impl=impl)
        pools[impl].assert_only_slots_written(slots)
    chosen = launch.choose_store(k, pools["torch"].pages, IndexerKeyFormat(fmt, head_dim), weight, bias)
    assert (chosen.block_t, chosen.num_warps) == (launch.SMALL_TOKENS_PER_PROGRAM, 1)
    assert_fused_close(fmt, pools[impl_for(device)], pools["torch"], slots)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, fused", [("fp8", False), ("fp8", True), ("mxfp4", True)])
@pytest.mark.parametrize("num_tokens", [2, 64, 8192])
def test_back_to_back_stores_keep_their_order(fmt, fused, num_tokens):
    """On Hopper the stores are launched with programmatic dependent launch: a store starts
    while the one before it runs. Each must still wait for the last one's writes and its
    inputs: the same slots stored with new keys, right after a copy that makes those keys,
    end as the last store made them, and in a CUDA graph too."""
    from dsacache.ops.triton_utils import dependent_launch

    num_pages = max(2, 2 * num_tokens // PAGE)
    slots = random_slots(num_tokens, num_pages, "cuda")
    weight = torch.randn(128, device="cuda")
    bias = torch.randn(128, device="cuda") * 0.1
    keys = [random_keys(num_tokens, 128, torch.bfloat16, "cuda") for _ in range(3)]
    pool, ref = PackedPool(fmt, 128, num_pages, "cuda"), PackedPool(fmt, 128, num_pages, "cuda")
    staged = torch.empty_like(keys[0])

    def store(k, pages, impl="auto"):
        if fused:
            fused_norm_store_indexer_keys(k, weight, bias, pages, slots, fmt, impl=impl, check_slots=False)
        else:
            store_indexer_keys(k, pages, slots, fmt, impl=impl, check_slots=False)

    def steps():
        for k in keys:
            store(k, pool.pages)
            staged.copy_(k.flip(0))  # the next store's input, written by the kernel just before it
            store(staged, pool.pages)

    steps()
    store(keys[-1].flip(0), ref.pages, impl="torch")
    assert dependent_launch(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    for attempt in ("eager", "graph"):
        if attempt == "graph":
            pool.raw.fill_(SENTINEL)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                steps()
            pool.raw.fill_(SENTINEL)  # capturing ran nothing; the replay alone writes
            graph.replay()
        torch.cuda.synchronize()
        if fmt == "fp8":
            assert_fp8_close(pool, ref, slots)
        else:
            valid = slots[slots >= 0]
            a, b = torch.cat(pool.entries(valid), dim=1), torch.cat(ref.entries(valid), dim=1)
            assert float((a != b).float().mean()) < 1e-3, attempt
        pool.assert_only_slots_written(slots)


def test_dependent_launch_only_where_compiled_for_hopper():
    """PDL (and its ``griddepcontrol`` instructions) only for compiled CUDA on sm_90 or newer:
    never on the CPU or under the interpreter, where the stores run without it."""
    from dsacache.ops.triton_utils import dependent_launch

    assert dependent_launch(torch.device("cpu")) is False


def test_reference_layer_norm_matches_torch():
    k, w, b = torch.randn(7, 128), torch.randn(128), torch.randn(128)
    out = naive.layer_norm(k, w, b, 1e-6)
    assert rel_rms_error(out, F.layer_norm(k, (128,), w, b, 1e-6)) < 1e-6


def launch_module():
    """``dsacache.ops.indexer_k_cache.launch`` (imports triton, hence not at the top)."""
    from dsacache.ops.indexer_k_cache import launch

    return launch


def mxfp4(head_dim):
    return IndexerKeyFormat("mxfp4", head_dim)


#: The MXFP4 store paths a test can force: the one-tile kernel (what small batches run), the same
#: with 64-bit slot math (pools of 2**31 slots or more), and the fused LayerNorm tile loop.
MXFP4_PATHS = ("tile", "tile_slots64", "loop")


def mxfp4_launch(path, monkeypatch):
    """The ``launch`` argument of ``launch_store`` that runs ``path`` (``tile_slots64``: every pool
    counts as one of 2**31 slots or more)."""
    launch = launch_module()
    if path == "tile_slots64":
        monkeypatch.setattr(launch, "SLOTS_32BIT", 0)
    if path == "loop":
        return launch.StoreLaunch("mxfp4_loop", launch.LOOP_TOKENS_PER_TILE, launch.LOOP_WARPS)
    return None


def mxfp4_store_both(x, device, num_pages=2):
    """Store ``x`` as MXFP4 through the Triton kernel without the norm, and through the reference codec."""
    slots = torch.arange(x.shape[0], device=device)
    tri = PackedPool("mxfp4", x.shape[1], num_pages, device)
    launch_module().launch_store(x.to(device), tri.pages, slots, mxfp4(x.shape[1]))
    ref = PackedPool("mxfp4", x.shape[1], num_pages, device)
    naive.store_quantized(x.to(device), ref.pages, slots, mxfp4(x.shape[1]))
    return slots, tri, ref


# Hand-picked MXFP4 values at scale 1 (each group has amax 6): every rounding threshold
# (ties go to the even code), signed zeros, +-6, and a few just off the ties.
MXFP4_EDGES = [6.0, -6.0, 0.0, -0.0, 0.25, -0.25, 0.75, -0.75, 1.25, -1.25, 1.75, -1.75, 2.5, -2.5,
               3.5, -3.5, 5.0, -5.0, 0.2499, 0.2501, 0.7499, 1.2501, 1.7499, 2.4999, 2.5001, 3.4999,
               4.9999, 5.0001, 0.5, 1.0, 3.0, 4.0]


def mxfp4_edge_groups():
    """Groups of 32: the edge list at scale 1 and 2**-10, an all-zero group, and inf/NaN groups."""
    edges = torch.tensor(MXFP4_EDGES)
    inf_group = torch.zeros(32)
    inf_group[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan")])
    nan_group = torch.full((32,), float("nan"))
    return torch.cat([edges, edges * 2.0 ** -10, torch.zeros(32), -torch.zeros(32), inf_group, nan_group,
                      edges * 2.0 ** 100, edges * 2.0 ** -120])


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp4_codes_bit_identical(device):
    """The Triton MXFP4 quantizer against the reference codec: random and hand-picked values."""
    x = random_keys(16 if device == "cpu" else 4096, 128, torch.float32, device)
    slots, tri, ref = mxfp4_store_both(x, device, num_pages=max(2, x.shape[0] // PAGE))
    assert torch.equal(tri.raw, ref.raw)
    edges = mxfp4_edge_groups().view(2, -1)
    slots, tri, ref = mxfp4_store_both(edges, device)
    assert torch.equal(tri.raw, ref.raw)
    packed, scales = quantize_mxfp4(edges)
    for t in range(2):
        values, scale_bytes = tri.raw_entry(t)
        assert torch.equal(values, packed[t]) and torch.equal(scale_bytes, scales[t])
    decoded = dequantize_indexer_keys(packed.to(device), scales.to(device), "mxfp4", impl=impl_for(device))
    assert torch.equal(decoded.cpu(), naive.dequantize_indexer_keys(packed, scales, mxfp4(128)))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_mxfp4_ties_through_bias(device):
    """With k = 0 and weight = -1 the LayerNorm output is exactly ``bias``, so hand-picked
    values reach the fused MXFP4 insert unchanged, signed zeros included."""
    bias = mxfp4_edge_groups()[:256]
    zeros = torch.zeros(3, 256, device=device)
    weight = -torch.ones(256, device=device)
    slots = torch.tensor([0, 70, 5], device=device)
    for impl in (impl_for(device), "torch"):
        pool = PackedPool("mxfp4", 256, 2, device)
        fused_norm_store_indexer_keys(zeros, weight, bias.to(device), pool.pages, slots, "mxfp4", impl=impl)
        packed, scales = quantize_mxfp4(bias)
        for s in slots.tolist():
            values, scale_bytes = pool.raw_entry(s)
            assert torch.equal(values, packed) and torch.equal(scale_bytes, scales)
        pool.assert_only_slots_written(slots)


E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_hard_groups(dtype, scales):
    """Rows ``[n, 128]`` of 32-value groups in ``dtype``: at each power-of-two scale, every e2m1
    grid value and tie, the neighbours of each tie and of 1, 2, 4 one ``dtype`` step away, both
    signs (each group holds +-6, so the scale is the given one); then zero, -0, inf/NaN, all-NaN
    (both signs) and all -inf groups, padded with random groups."""
    base = torch.tensor(E2M1_TIES, dtype=dtype)
    up = torch.nextafter(base, torch.full_like(base, float("inf")))
    down = torch.nextafter(base, torch.zeros_like(base))
    powers = torch.tensor([1.0, 2.0, 4.0], dtype=dtype)
    below = torch.nextafter(powers, torch.zeros_like(powers))
    grid = torch.tensor(E2M1, dtype=dtype)
    positive = torch.cat([grid, base, up, down, below])          # 8 + 7 * 3 + 3 = 32 values
    groups = []
    for scale in scales:
        for sign in (1.0, -1.0):
            groups.append(positive * sign * 2.0 ** scale)
    special = torch.zeros(32, dtype=dtype)
    special[:6] = torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan"), 1.5, -2.5])
    groups += [torch.zeros(32, dtype=dtype), -torch.zeros(32, dtype=dtype), special,
               torch.full((32,), float("nan"), dtype=dtype), -torch.full((32,), float("nan"), dtype=dtype),
               torch.full((32,), -float("inf"), dtype=dtype)]
    while len(groups) % 4:
        groups.append(torch.randn(32).to(dtype))
    return torch.cat(groups).view(-1, 128)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["tile", "tile_slots64"])
@pytest.mark.parametrize("dtype,scales", [(torch.bfloat16, (0, -10, 100, -120)), (torch.float16, (0, -10, 10)),
                                          (torch.float32, (0, -10, 100, -120))])
def test_mxfp4_quantizer_bit_identical(device, path, dtype, scales, monkeypatch):
    """The MXFP4 encoder against the reference codec, byte for byte: hand-picked values in every
    key dtype (bf16 and fp16 take the encoder's short-mantissa path) and random keys."""
    rows = e2m1_hard_groups(dtype, scales)
    x = torch.cat([rows, random_keys(6, 128, dtype, "cpu")]).to(device)
    slots = torch.randperm(3 * PAGE)[: x.shape[0]].to(device)
    tri, ref = PackedPool("mxfp4", 128, 3, device), PackedPool("mxfp4", 128, 3, device)
    launch_module().launch_store(x, tri.pages, slots, mxfp4(128), launch=mxfp4_launch(path, monkeypatch))
    naive.store_quantized(x.float(), ref.pages, slots, mxfp4(128))
    assert torch.equal(tri.raw, ref.raw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", MXFP4_PATHS)
def test_fused_mxfp4_paths_hand_picked(device, path, monkeypatch):
    """Hand-picked fp32 LayerNorm outputs (through the bias, k = 0 and weight = -1) reach each
    fused store path unchanged and come out as the reference codec's bytes (the loop takes bf16
    keys; biases with inf or above 2**100 take its guarded copy, the others the lean one)."""
    rows = e2m1_hard_groups(torch.float32, (0, -10, 100, -120))
    weight = -torch.ones(128, device=device)
    zeros = torch.zeros(3, 128, device=device, dtype=torch.bfloat16 if path == "loop" else torch.float32)
    slots = torch.tensor([0, 70, 5], device=device)
    launch = mxfp4_launch(path, monkeypatch)
    for bias in rows:
        pool = PackedPool("mxfp4", 128, 2, device)
        launch_module().launch_store(zeros, pool.pages, slots, mxfp4(128), weight, bias.to(device), 1e-6,
                                     launch=launch)
        packed, scales = quantize_mxfp4(bias)
        for s in slots.tolist():
            values, scale_bytes = pool.raw_entry(s)
            assert torch.equal(values, packed) and torch.equal(scale_bytes, scales)
        pool.assert_only_slots_written(slots)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_mxfp4_paths_agree(device, monkeypatch):
    """Random keys and LayerNorm parameters: the one-tile kernel stores the same bytes with 32- and
    64-bit slot math; the tile loop takes its LayerNorm statistics from the tensor cores, so a code
    may move by a LayerNorm last bit (~2e-7 of them on 1M random keys), nothing more."""
    k = random_keys(20 if device == "cpu" else 4096, 128, torch.bfloat16, device)
    weight, bias = torch.randn(128, device=device), torch.randn(128, device=device) * 0.1
    slots = torch.randperm(k.shape[0] + 8)[: k.shape[0]].to(device)
    raws = {}
    for path in ("tile", "loop", "tile_slots64"):
        pool = PackedPool("mxfp4", 128, k.shape[0] // PAGE + 2, device)
        launch_module().launch_store(k, pool.pages, slots, mxfp4(128), weight, bias, 1e-6,
                                     launch=mxfp4_launch(path, monkeypatch))
        raws[path] = pool.raw
        pool.assert_only_slots_written(slots)
    assert torch.equal(raws["tile_slots64"], raws["tile"])
    assert float((raws["loop"] != raws["tile"]).float().mean()) <= 1e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias_scale", [0.1, 2.0 ** 120])
def test_fused_mxfp4_loop_several_tiles_a_program(device, bias_scale):
    """The tile loop with several tiles a program (one program an SM) and a partial last tile, on its
    lean copy (small bias) and its guarded one (a bias above 2**100): the bytes of the one-tile
    kernel (on the lean copy but for rare LayerNorm last bits of the moments), skipped slots untouched."""
    from dsacache.ops.triton_utils import sm_count

    launch = launch_module()
    programs = sm_count(torch.device(device)) or 4
    num_tokens = 16 * programs * 3 + 5
    k = random_keys(num_tokens, 128, torch.bfloat16, device)
    weight, bias = torch.randn(128, device=device), torch.randn(128, device=device) * bias_scale
    num_pages = num_tokens // PAGE + 2
    slots = random_slots(num_tokens, num_pages, device, num_skipped=num_tokens // 8)
    want, got = PackedPool("mxfp4", 128, num_pages, device), PackedPool("mxfp4", 128, num_pages, device)
    assert launch.choose_store(k, want.pages, mxfp4(128), weight, bias).kernel == "mxfp4"
    launch.launch_store(k, want.pages, slots, mxfp4(128), weight, bias, 1e-6)
    loop = launch.StoreLaunch("mxfp4_loop", launch.LOOP_TOKENS_PER_TILE, launch.LOOP_WARPS, programs=programs)
    launch.launch_store(k, got.pages, slots, mxfp4(128), weight, bias, 1e-6, launch=loop)
    if bias_scale < 1:
        assert float((got.raw != want.raw).float().mean()) <= 1e-4
    else:
        assert torch.equal(got.raw, want.raw)
    got.assert_only_slots_written(slots)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_mxfp4_moments_fall_back_to_two_passes(device):
    """A tile with one token the raw moments cannot serve (mean**2 > 16 var: a large offset; NaN;
    inf; a sum of squares past fp32) takes the exact two-pass LayerNorm: every tile here has one,
    so the bytes are exactly those of the one-tile kernel (two passes too), and tokens next to
    them are unaffected."""
    launch = launch_module()
    tiles = 12 if device == "cpu" else 4 * 132 * 3
    num_tokens = launch.LOOP_TOKENS_PER_TILE * tiles
    k = random_keys(num_tokens, 128, torch.float32, device)
    bad = torch.arange(tiles, device=device) * 8 + torch.arange(tiles, device=device) % 8
    kinds = torch.arange(tiles, device=device) % 4
    k[bad[kinds == 0]] += 50.0 * k[bad[kinds == 0]].abs().amax(dim=1, keepdim=True)
    k[bad[kinds == 1], 5] = float("nan")
    k[bad[kinds == 2], 77] = float("-inf")
    k[bad[kinds == 3], 9] = 3.0e20            # finite in bf16, its square is not in fp32
    k = k.to(torch.bfloat16)
    weight, bias = torch.randn(128, device=device), torch.randn(128, device=device) * 0.1
    num_pages = num_tokens // PAGE + 2
    slots = random_slots(num_tokens, num_pages, device, num_skipped=num_tokens // 16)
    want, got = PackedPool("mxfp4", 128, num_pages, device), PackedPool("mxfp4", 128, num_pages, device)
    assert launch.choose_store(k, want.pages, mxfp4(128), weight, bias).kernel == "mxfp4"
    launch.launch_store(k, want.pages, slots, mxfp4(128), weight, bias, 1e-6)
    loop = launch.StoreLaunch("mxfp4_loop", launch.LOOP_TOKENS_PER_TILE, launch.LOOP_WARPS)
    launch.launch_store(k, got.pages, slots, mxfp4(128), weight, bias, 1e-6, launch=loop)
    assert torch.equal(got.raw, want.raw)
    got.assert_only_slots_written(slots)


def test_store_launch_choice():
    """Which kernel each batch gets: small batches one-warp programs with the raw-moment LayerNorm,
    large fused bf16 MXFP4 the tile loop (not with fp16 keys or without the norm), every FP8 batch
    the FP8 kernel; past the small batches the exact two-pass statistics."""
    launch = launch_module()
    pages = PackedPool("mxfp4", 128, 2, "cpu").pages
    w, b = torch.ones(128), torch.zeros(128)

    def choice(num_tokens, dtype=torch.bfloat16, norm=True, fmt=mxfp4(128), pool=pages):
        k = torch.empty(num_tokens, 128, dtype=dtype)
        return launch.choose_store(k, pool, fmt, w if norm else None, b if norm else None)

    assert choice(1) == launch.StoreLaunch("mxfp4", launch.SMALL_TOKENS_PER_PROGRAM, 1, moments="raw")
    assert choice(launch.SMALL_BATCH).moments == "raw" and choice(launch.SMALL_BATCH + 1).moments == "two_pass"
    assert choice(launch.LARGE_BATCH).kernel == "mxfp4_loop"
    assert choice(launch.LARGE_BATCH - 1).kernel == "mxfp4"
    assert choice(launch.LARGE_BATCH, dtype=torch.float16).block_t == launch.LARGE_MXFP4_TOKENS_PER_PROGRAM
    assert choice(launch.LARGE_BATCH, norm=False).kernel == "mxfp4"
    fp8_pages = PackedPool("fp8", 128, 2, "cpu").pages
    assert choice(launch.LARGE_BATCH, fmt=IndexerKeyFormat("fp8", 128), pool=fp8_pages).kernel == "fp8"


def test_forced_launch_checks_its_preconditions():
    launch = launch_module()
    pool = PackedPool("mxfp4", 128, 2, "cpu")
    k, slots = torch.zeros(4, 128, dtype=torch.float16), torch.arange(4)
    loop = launch.StoreLaunch("mxfp4_loop", 8, 1)
    with pytest.raises(ValueError, match="tile loop"):
        launch.launch_store(k, pool.pages, slots, mxfp4(128), torch.ones(128), torch.zeros(128), 1e-6, launch=loop)
    with pytest.raises(ValueError, match="stores mxfp4"):
        launch.launch_store(k, pool.pages, slots, mxfp4(128), launch=launch.StoreLaunch("fp8", 2, 1))
    with pytest.raises(ValueError, match="moments"):
        launch.StoreLaunch("fp8", 2, 1, moments="welford")
    assert bool((pool.raw == SENTINEL).all())


# ---- byte layout and round trip -------------------------------------------------------

def e4m3_half_step(y):
    """Half the e4m3 code spacing at magnitude ``|y|`` (spacing 2**-9 below 2**-6)."""
    exponent = torch.floor(torch.log2(y.abs().clamp_min(2.0 ** -6)))
    return 0.5 * 2.0 ** (exponent - 3)


def e2m1_half_step(y):
    mag = y.abs()
    return torch.where(mag < 2, 0.25, torch.where(mag < 4, 0.5, 1.0))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_layout_and_round_trip(device):
    """Keys rebuilt from raw page bytes by the layout of docs/layout.md alone are within half a step."""
    k = random_keys(70, 128, torch.float32, device)
    pool = PackedPool("fp8", 128, 3, device)
    slots = random_slots(70, 3, device)
    store_indexer_keys(k, pool.pages, slots, impl=impl_for(device))
    _, scale = quantize_fp8(k.cpu())
    for t, s in enumerate(slots.tolist()):
        decoded = pool.decode_raw(s)
        x = k[t].cpu()
        assert torch.all((decoded - x).abs() <= e4m3_half_step(x / scale[t]) * scale[t])


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp4_layout_and_round_trip(device):
    x = random_keys(8, 128, torch.float32, device)
    slots, tri, _ = mxfp4_store_both(x, device)
    exponents = quantize_mxfp4(x.cpu())[1].int() - 127
    for t in range(8):
        scale = (2.0 ** exponents[t].double()).repeat_interleave(32)
        decoded, xt = tri.decode_raw(t).double(), x[t].cpu().double()
        assert torch.all((decoded - xt).abs() <= e2m1_half_step(xt / scale) * scale)


# ---- edge cases ---------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_partly_filled_last_page_and_skipped_slots(device):
    k = random_keys(80, 128, torch.bfloat16, device)
    slots = torch.arange(80, device=device)
    slots[70:] = -1  # page 1 gets rows 0..5 only
    pool = PackedPool("fp8", 128, 2, device)
    store_indexer_keys(k, pool.pages, slots, impl=impl_for(device))
    pool.assert_only_slots_written(slots)
    assert not bool((pool.raw_entry(69)[0] == SENTINEL).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens", [0, 5])
def test_no_valid_slot_writes_nothing(device, num_tokens):
    k = random_keys(num_tokens, 128, torch.bfloat16, device)
    slots = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)
    for fmt in ("fp8", "mxfp4"):
        pool = PackedPool(fmt, 128, 2, device)
        w, b = torch.ones(128, device=device), torch.zeros(128, device=device)
        fused_norm_store_indexer_keys(k, w, b, pool.pages, slots, fmt, impl=impl_for(device))
        if fmt == "fp8":
            store_indexer_keys(k, pool.pages, slots, impl=impl_for(device))
        assert bool((pool.raw == SENTINEL).all())


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_slots(device):
    """Rule: the reference keeps the last token; Triton defines the entry when the repeats agree."""
    k = random_keys(6, 128, torch.float32, device)
    k[3] = k[1]
    slots = torch.tensor([9, 4, 8, 4, 9, 100], device=device)
    tri = PackedPool("fp8", 128, 2, device)
    store_indexer_keys(k, tri.pages, slots, impl=impl_for(device))
    values, scale = quantize_fp8(k[1].cpu())
    assert torch.equal(tri.raw_entry(4)[0], values.view(torch.uint8))
    tri.assert_only_slots_written(slots)
    ref = PackedPool("fp8", 128, 2, device)
    store_indexer_keys(k, ref.pages, slots, impl="torch")
    assert torch.equal(ref.raw_entry(9)[0], quantize_fp8(k[4].cpu())[0].view(torch.uint8))
    ref.assert_only_slots_written(slots)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_keys(device):
    base = random_keys(30, 384, torch.bfloat16, device)
    slots = torch.arange(10, device=device) * 7
    for k in (base[::3, :128], base[:10, ::3]):
        strided, contiguous = PackedPool("fp8", 128, 2, device), PackedPool("fp8", 128, 2, device)
        store_indexer_keys(k, strided.pages, slots, impl=impl_for(device))
        store_indexer_keys(k.contiguous(), contiguous.pages, slots, impl=impl_for(device))
        assert torch.equal(strided.raw, contiguous.raw)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_keys_get_the_floor_scale(device):
    k = torch.zeros(3, 128, device=device)
    slots = torch.tensor([0, 1, 2], device=device)
    pool = PackedPool("fp8", 128, 2, device)
    store_indexer_keys(k, pool.pages, slots, impl=impl_for(device))
    values, scales = pool.raw_entry(1)
    # max(amax, 1e-4) / 448 rounds up to 2**-22.
    assert bool((values == 0).all()) and struct.unpack("<f", bytes(scales.tolist()))[0] == 2.0 ** -22
    _, mx, _ = mxfp4_store_both(k, device)
    values, scales = mx.raw_entry(2)
    assert bool((values == 0).all()) and bool((scales == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_huge_and_non_finite_fp8(device):
    """Rule (formats/indexer_key.py): scale from finite elements, inf saturates, NaN stores NaN."""
    k = torch.randn(4, 128)
    k[0, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    k[1, 0] = 3e38
    k[2] = float("nan")
    k[3, 5] = -1e30
    slots = torch.tensor([3, 2, 1, 0], device=device)
    pool = PackedPool("fp8", 128, 2, device)
    store_indexer_keys(k.to(device), pool.pages, slots, impl=impl_for(device))
    values, scales = quantize_fp8(k)
    for t, s in enumerate(slots.tolist()):
        got_values, got_scale = pool.raw_entry(s)
        assert torch.equal(got_scale.view(torch.float32), scales[t:t + 1])
        want = values[t].view(torch.uint8)
        nan = torch.isnan(values[t].float())
        assert torch.equal(torch.isnan(got_values.view(torch.float8_e4m3fn).float()), nan)
        assert int(e4m3_code_distance(got_values[~nan], want[~nan]).max(), ) <= 1 if bool((~nan).any()) else True
    assert pool.raw_entry(3)[0][0] == 0x7E and pool.raw_entry(3)[0][1] == 0xFE  # +-448


@pytest.mark.parametrize("device", DEVICES)
def test_fused_nan_input_rule(device):
    k = torch.randn(2, 128, device=device)
    k[0, 7] = float("nan")
    w, b = torch.ones(128, device=device), torch.zeros(128, device=device)
    slots = torch.tensor([0, 1], device=device)
    for fmt in ("fp8", "mxfp4"):
        pool = PackedPool(fmt, 128, 2, device)
        fused_norm_store_indexer_keys(k, w, b, pool.pages, slots, fmt, impl=impl_for(device))
        if fmt == "fp8":
            assert bool(torch.isnan(pool.decode_raw(0)).all())
        else:
            values, scales = pool.raw_entry(0)
            assert bool((values == 0).all()) and bool((scales == 0).all())
        assert bool(torch.isfinite(pool.decode_raw(1)).all())


# ---- bad input: a clear error, nothing written -------------------------------------------

def bad_store_calls(device, impl):
    """(message, call on fp8 pages) pairs: each call must raise ValueError matching the message."""
    k = torch.randn(4, 128, device=device)
    slots = torch.tensor([0, 1, 2, 3], device=device)
    w, b = torch.ones(128, device=device), torch.zeros(128, device=device)

    def store(keys, p, slot_mapping, *args, **kw):
        store_indexer_keys(keys, p, slot_mapping, *args, impl=kw.pop("impl", impl), **kw)

    def fused(keys, weight, bias, p, slot_mapping, *args, **kw):
        fused_norm_store_indexer_keys(keys, weight, bias, p, slot_mapping, *args, impl=kw.pop("impl", impl), **kw)

    return [
        ("k.dtype", lambda p: store(k.to(torch.int32), p, slots)),
        ("2-D", lambda p: store(k[0], p, slots)),
        ("match no key format at head_dim=96", lambda p: store(k[:, :96], p, slots)),
        ("do not hold fp8 keys of head_dim=96", lambda p: store(k[:, :96], p, slots, "fp8")),
        ("do not hold mxfp4 keys of head_dim=128", lambda p: fused(k, w, b, p, slots, "mxfp4")),
        ("slot_mapping values", lambda p: store(k, p, torch.tensor([0, 1, 2, 128], device=device))),
        ("slot_mapping values", lambda p: store(k, p, torch.tensor([0, -2, 2, 3], device=device))),
        ("slot_mapping has 3", lambda p: store(k, p, slots[:3])),
        ("int32 or int64", lambda p: store(k, p, slots.float())),
        ("fused LayerNorm insert", lambda p: store(k, p, slots, "mxfp4")),
        ("allowed: auto", lambda p: store(k, p, slots, "int8")),
        ("allowed: auto", lambda p: fused(k, w, b, p, slots, "e4m3")),
        ("weight must be", lambda p: fused(k, w[:64], b, p, slots)),
        ("eps", lambda p: fused(k, w, b, p, slots, eps=-1.0)),
        ("multiple of 32", lambda p: fused(k[:, :48], w[:48], b[:48], p, slots, "mxfp4")),
        ("impl", lambda p: store(k, p, slots, impl="cuda")),
        # Wrong argument types: a ValueError naming the argument, never a TypeError from inside.
        ("slot_mapping must be a torch.Tensor", lambda p: store(k, p, [0, 1, 2, 3])),
        ("slot_mapping must be a torch.Tensor", lambda p: fused(k, w, b, p, None)),
        ("eps='1e-6' must be a finite number", lambda p: fused(k, w, b, p, slots, eps="1e-6")),
        ("eps=True must be a finite number", lambda p: fused(k, w, b, p, slots, eps=True)),
        ("eps=inf", lambda p: fused(k, w, b, p, slots, eps=float("inf"))),
        ("check_slots must be True or False", lambda p: store(k, p, slots, check_slots=1)),
        ("indexer_kv_dtype must be a string", lambda p: store(k, p, slots, 8)),
        ("indexer pages must be a uint8 view", lambda p: store(k, p.tolist(), slots)),
        ("bias must be", lambda p: fused(k, w, 0.0, p, slots)),
        ("k must be a 2-D tensor", lambda p: store(k.tolist(), p, slots)),
        ("impl", lambda p: store(k, p, slots, impl=None)),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_bad_input_raises_and_writes_nothing(device, path):
    """Both paths refuse the same calls, before a byte is written."""
    impl = "torch" if path == "torch" else impl_for(device)
    for message, call in bad_store_calls(device, impl):
        pool = PackedPool("fp8", 128, 2, device)
        with pytest.raises(ValueError, match=message):
            call(pool.pages)
        assert bool((pool.raw == SENTINEL).all()), message


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_misaligned_pages_are_refused_by_both_paths(device, path):
    """The stores write 32-bit words: pages off a 4-byte boundary are refused (FP8 and MXFP4)."""
    impl = "torch" if path == "torch" else impl_for(device)
    k, slots = torch.randn(2, 128, device=device), torch.tensor([0, 1], device=device)
    w, b = torch.ones(128, device=device), torch.zeros(128, device=device)
    for fmt in ("fp8", "mxfp4"):
        entry = entry_bytes(fmt, 128)
        raw = torch.full((2 * 64 * entry + 4,), SENTINEL, dtype=torch.uint8, device=device)
        pages = raw.as_strided((2, 64, entry), (64 * entry, entry, 1), 1)
        with pytest.raises(ValueError, match="4-byte aligned"):
            fused_norm_store_indexer_keys(k, w, b, pages, slots, impl=impl)
        assert bool((raw == SENTINEL).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_format_comes_from_the_pages(device, fmt):
    """Omitting the format reads it off the pages; the string and the layout's IndexerKeyFormat
    give the same bytes; gather and dequantize find it too."""
    k = random_keys(70, 128, torch.bfloat16, device)
    w, b = torch.randn(128, device=device), torch.randn(128, device=device) * 0.1
    slots = random_slots(70, 3, device, num_skipped=5)
    raws = []
    for given in (None, fmt, IndexerKeyFormat(fmt, 128)):
        pool = PackedPool(fmt, 128, 3, device)
        fused_norm_store_indexer_keys(k, w, b, pool.pages, slots, given, impl=impl_for(device))
        if fmt == "fp8":
            store_indexer_keys(k, pool.pages, slots, given, impl=impl_for(device))
        raws.append(pool.raw)
    assert all(torch.equal(raw, raws[0]) for raw in raws)
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 150], dtype=torch.int32, device=device)
    for impl in (impl_for(device), "torch"):
        found = gather_indexer_keys(pool.pages, table, cu, 128, impl=impl)
        named = gather_indexer_keys(pool.pages, table, cu, 128, IndexerKeyFormat(fmt, 128), impl=impl)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(found, named))
        assert torch.equal(dequantize_indexer_keys(*found, impl=impl), dequantize_indexer_keys(*found, fmt, impl=impl))


def test_wrong_format_strings_get_the_clear_error():
    """A misspelt or mismatched format names the setting and what is allowed, on every public function."""
    fp8, mx = PackedPool("fp8", 128, 2, "cpu"), PackedPool("mxfp4", 128, 2, "cpu")
    k, slots = torch.randn(2, 128), torch.tensor([0, 1])
    w, b = torch.ones(128), torch.zeros(128)
    table, cu = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    allowed = r"indexer_kv_dtype='fp4' is not supported; allowed: auto, fp8, mxfp4"
    for call in (lambda: store_indexer_keys(k, fp8.pages, slots, "fp4"),
                 lambda: fused_norm_store_indexer_keys(k, w, b, mx.pages, slots, "fp4"),
                 lambda: gather_indexer_keys(mx.pages, table, cu, 128, "fp4"),
                 lambda: dequantize_indexer_keys(torch.zeros(2, 64, dtype=torch.uint8),
                                                 torch.zeros(2, 4, dtype=torch.uint8), "fp4")):
        with pytest.raises(ValueError, match=allowed):
            call()
    with pytest.raises(ValueError, match="do not hold fp8 keys of head_dim=128"):
        fused_norm_store_indexer_keys(k, w, b, mx.pages, slots, "fp8")
    with pytest.raises(ValueError, match="do not hold mxfp4 keys of head_dim=128"):
        gather_indexer_keys(fp8.pages, table, cu, 128, "mxfp4")
    with pytest.raises(ValueError, match="MXFP4 pages; indexer_kv_dtype='mxfp4' is written only by the fused"):
        store_indexer_keys(k, mx.pages, slots)
    with pytest.raises(ValueError, match="indexer key format is for head_dim=64"):
        store_indexer_keys(k, fp8.pages, slots, IndexerKeyFormat("fp8", 64))
    assert bool((fp8.raw == SENTINEL).all()) and bool((mx.raw == SENTINEL).all())


@pytest.mark.parametrize("device", DEVICES)
def test_not_an_indexer_view_is_refused(device):
    k = torch.randn(2, 128, device=device)
    slots = torch.tensor([0, 1], device=device)
    raw = torch.full((4 * 64 * 656,), SENTINEL, dtype=torch.uint8, device=device)
    mla_view = raw.view(4, 64, 656)
    not_contiguous = raw[: 4 * 64 * 264].view(4, 64, 264)[:, :, :132]
    for pages in (mla_view, not_contiguous, raw.view(torch.int32)[:4 * 64 * 33].view(4, 64, 33)):
        with pytest.raises(ValueError, match="indexer pages|page must be contiguous"):
            store_indexer_keys(k, pages, slots)
    assert bool((raw == SENTINEL).all())


# ---- gather and dequantize ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_gather_and_dequantize(device, fmt):
    seq_lens = [0, 1, 63, 64, 65, 130]
    num_pages = 16
    block_table = torch.randperm(num_pages)[:12].view(6, 2).int().to(device)
    block_table[5, 1] = -1  # positions 64..129 of the last request: no page, gathered as zeros
    cu_seqlens = torch.tensor([0] + seq_lens, dtype=torch.int32).cumsum(0).int().to(device)
    pool = PackedPool(fmt, 128, num_pages, device)
    k = random_keys(num_pages * PAGE, 128, torch.bfloat16, device)
    w, b = torch.ones(128, device=device), torch.zeros(128, device=device)
    fused_norm_store_indexer_keys(k, w, b, pool.pages, torch.arange(num_pages * PAGE, device=device), fmt)
    outputs = {}
    for impl in (impl_for(device), "torch"):
        values, scales = gather_indexer_keys(pool.pages, block_table, cu_seqlens, 128, fmt, impl=impl)
        keys = dequantize_indexer_keys(values, scales, fmt, impl=impl)
        outputs[impl] = (values.view(torch.uint8).cpu(), scales.view(torch.uint8).cpu(), keys.cpu())
    for got, want in zip(outputs[impl_for(device)], outputs["torch"]):
        assert torch.equal(got, want)
    keys = outputs["torch"][2]
    start = int(cu_seqlens[4])  # request 4, position 64: block_table[4, 1], row 0
    assert torch.equal(keys[start + 64], pool.decode_raw(int(block_table[4, 1]) * PAGE))
    assert bool((keys[int(cu_seqlens[5]) + 64:] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_gather_follows_the_block_table_rule(device):
    """Entries -7 and num_pages, and positions past the table's width, gather as zero bytes on
    both paths; usable blocks around them gather their page."""
    pool = PackedPool("mxfp4", 128, 3, device)
    k = random_keys(3 * PAGE, 128, torch.bfloat16, device)
    w, b = torch.ones(128, device=device), torch.zeros(128, device=device)
    fused_norm_store_indexer_keys(k, w, b, pool.pages, torch.arange(3 * PAGE, device=device), impl=impl_for(device))
    table = torch.tensor([[2, -7], [3, 0]], dtype=torch.int32, device=device)   # 3 == num_pages
    cu = torch.tensor([0, 150, 250], dtype=torch.int32, device=device)         # request 0 runs past the table
    outputs = [gather_indexer_keys(pool.pages, table, cu, 128, impl=impl) for impl in (impl_for(device), "torch")]
    for got, want in zip(*outputs):
        assert torch.equal(got, want)
    values, scales = (t.cpu() for t in outputs[1])
    page2 = pool.entries(torch.arange(2 * PAGE, 3 * PAGE))
    assert torch.equal(values[:PAGE], page2[0]) and torch.equal(scales[:PAGE], page2[1])
    page0 = pool.entries(torch.arange(PAGE))
    assert torch.equal(values[150 + PAGE:], page0[0][:100 - PAGE])
    zero = torch.ones(250, dtype=torch.bool)
    zero[:PAGE] = False
    zero[150 + PAGE:] = False
    assert bool((values[zero] == 0).all()) and bool((scales[zero] == 0).all())


def test_gather_validates_metadata():
    pool = PackedPool("fp8", 128, 2, "cpu")
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gather_indexer_keys(pool.pages, table, torch.tensor([0, 3], dtype=torch.int32), 128, "fp8")
    with pytest.raises(ValueError, match="block_table"):
        gather_indexer_keys(pool.pages, table.long(), torch.tensor([0, 3, 4], dtype=torch.int32), 128, "fp8")


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_gather_and_dequantize_refuse_wrong_types(impl):
    """A ValueError naming the argument, on both paths (never a TypeError from inside)."""
    pool = PackedPool("fp8", 128, 2, "cpu")
    table, cu = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 70], dtype=torch.int32)
    values, scales = torch.zeros(2, 128).to(torch.float8_e4m3fn), torch.ones(2)
    calls = [
        ("head_dim must be an integer >= 1, got '128'", lambda: gather_indexer_keys(pool.pages, table, cu, "128", impl=impl)),
        ("head_dim must be an integer >= 1, got True", lambda: gather_indexer_keys(pool.pages, table, cu, True, impl=impl)),
        ("head_dim must be an integer >= 1, got 'fp8'",
         lambda: gather_indexer_keys(pool.pages, table, cu, "fp8", 128, impl=impl)),
        ("num_tokens must be an integer >= 0, got 2.5",
         lambda: gather_indexer_keys(pool.pages, table, cu, 128, num_tokens=2.5, impl=impl)),
        ("num_tokens must be an integer >= 0, got -1",
         lambda: gather_indexer_keys(pool.pages, table, cu, 128, num_tokens=-1, impl=impl)),
        ("cu_seqlens must be a torch.Tensor", lambda: gather_indexer_keys(pool.pages, table, [0, 70], 128, impl=impl)),
        ("block_table must be an int32 tensor", lambda: gather_indexer_keys(pool.pages, [[0, 1]], cu, 128, impl=impl)),
        ("block_table must be at least 1 blocks wide",
         lambda: gather_indexer_keys(pool.pages, table[:, :0], cu, 128, impl=impl)),
        ("with no requests", lambda: gather_indexer_keys(pool.pages, table[:0], cu[:1], 128, num_tokens=3, impl=impl)),
        ("values must be a torch.Tensor", lambda: dequantize_indexer_keys(values.tolist(), scales, impl=impl)),
        ("scales must be a torch.Tensor", lambda: dequantize_indexer_keys(values, 1.0, impl=impl)),
        ("values.dtype=torch.float32", lambda: dequantize_indexer_keys(values.float(), scales, impl=impl)),
        ("indexer_kv_dtype=3 is not supported", lambda: dequantize_indexer_keys(values, scales, 3, impl=impl)),
    ]
    for message, call in calls:
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.parametrize("device", DEVICES)
def test_gather_takes_strided_metadata_on_both_paths(device):
    """A block table whose rows are not contiguous and a strided cu_seqlens gather the same bytes."""
    pool = PackedPool("fp8", 128, 4, device)
    store_indexer_keys(random_keys(256, 128, torch.float32, device), pool.pages, torch.arange(256, device=device),
                       impl=impl_for(device))
    wide = torch.tensor([[3, 9, 1, 9], [0, 9, 2, 9]], dtype=torch.int32, device=device)
    table = wide[:, ::2]
    cu = torch.tensor([0, 9, 100, 9, 130], dtype=torch.int32, device=device)[::2]
    want = gather_indexer_keys(pool.pages, table.contiguous(), cu.contiguous(), 128, impl="torch")
    for impl in (impl_for(device), "torch"):
        got = gather_indexer_keys(pool.pages, table, cu, 128, impl=impl)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))


def test_dequantize_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="MXFP4 keys"):
        dequantize_indexer_keys(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), "mxfp4")
    with pytest.raises(ValueError, match="FP8 keys"):
        dequantize_indexer_keys(torch.zeros(2, 128), torch.ones(2), "fp8")


def test_docstring_examples_run():
    pool = torch.zeros(4, 64, 132, dtype=torch.uint8)
    store_indexer_keys(torch.randn(3, 128), pool, torch.tensor([0, 65, -1]))
    values, scales = gather_indexer_keys(pool, torch.tensor([[2, 0]], dtype=torch.int32),
                                         torch.tensor([0, 70], dtype=torch.int32), 128)
    assert values.shape == (70, 128) and scales.shape == (70,)
    assert math.isclose(float(dequantize_indexer_keys(torch.ones(1, 128).to(torch.float8_e4m3fn),
                                                      torch.tensor([0.5]))[0, 0]), 0.5)
    pool = torch.zeros(4, 64, 68, dtype=torch.uint8)
    fused_norm_store_indexer_keys(torch.randn(3, 128), torch.ones(128), torch.zeros(128), pool,
                                  torch.tensor([0, 1, 2]))
    assert bool(pool.any())
