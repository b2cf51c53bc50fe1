"""The reference indexer-key codecs against ``docs/formats.md``, checked by hand.

Scales are compared with plain Python math on float64 (``2**ceil(log2(...))``). The code
picks them by exact integer arithmetic on the fp32 bits; for fp32 inputs the two agree:
at an exact boundary (amax = 448 * 2**k, or 6 * 2**k) the float64 quotient is an exact
power of two so ``log2`` is exact, and one fp32 ulp away the float64 quotient stays on
the same side of the power of two. Boundary values are also checked one ulp either side.
"""

import math
import random
import struct

import pytest
import torch

from dsacache.formats.indexer_key import (
    indexer_pages_format,
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_pages,
    e2m1_encode,
    fp8_page_views,
    fp8_scale,
    mxfp4_page_views,
    mxfp4_scale_exponent,
    quantize_fp8,
    quantize_mxfp4,
)

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code 0..7, sign in bit 3
SENTINEL = 0xA5


def fresh_seed():
    return random.SystemRandom().randrange(2**31)


def f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def next_up(value: float) -> float:
    return torch.nextafter(torch.tensor(value, dtype=torch.float32), torch.tensor(math.inf)).item()


def next_down(value: float) -> float:
    return torch.nextafter(torch.tensor(value, dtype=torch.float32), torch.tensor(-math.inf)).item()


def spec_fp8_scale(amax: float) -> float:
    return 2.0 ** math.ceil(math.log2(max(amax, 1e-4) / 448))


def spec_mxfp4_byte(amax: float) -> int:
    if amax == 0:
        return 0
    return min(max(math.ceil(math.log2(amax / 6)), -127), 127) + 127


def row_with_amax(amax: float, d: int = 128) -> torch.Tensor:
    x = torch.linspace(-0.5, 0.5, d, dtype=torch.float64) * amax
    x[d // 3] = -amax
    return x.float()


# --- FP8 ------------------------------------------------------------------------------------


def test_fp8_scale_random_magnitudes():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    rows = 3000
    magnitude = 10.0 ** (torch.rand(rows, 1, generator=g, dtype=torch.float64) * 24 - 12)
    x = (torch.randn(rows, 128, generator=g, dtype=torch.float64) * magnitude).float()
    got = fp8_scale(x).tolist()
    amax = x.abs().amax(-1).tolist()
    for i in range(rows):
        assert got[i] == spec_fp8_scale(amax[i]), (seed, i, amax[i], got[i])


@pytest.mark.parametrize("k", list(range(-20, 21, 3)))
def test_fp8_scale_at_power_of_two_boundaries(k):
    boundary = 448.0 * 2.0**k
    assert fp8_scale(row_with_amax(boundary)).item() == 2.0**k  # amax == 448 * s exactly
    assert fp8_scale(row_with_amax(next_down(boundary))).item() == 2.0**k
    assert fp8_scale(row_with_amax(next_up(boundary))).item() == 2.0 ** (k + 1)


def test_fp8_scale_exact_rule_on_random_values():
    # the smallest power of two s with max(amax, 1e-4) <= 448 * s, checked with exact rationals
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(500, 128, generator=g) * 10.0 ** (torch.rand(500, 1, generator=g) * 16 - 8)).float()
    for amax, s in zip(x.abs().amax(-1).tolist(), fp8_scale(x).tolist()):
        floor = max(amax, f32(1e-4))
        mantissa, _ = math.frexp(s)
        assert mantissa == 0.5, (seed, s)  # a power of two
        assert floor <= 448 * s and floor > 448 * (s / 2), (seed, amax, s)


def test_fp8_scale_floor():
    # amax below 1e-4 uses 1e-4: 1e-4 / 448 = 2.23e-7 -> 2**-22 (2.38e-7)
    assert fp8_scale(torch.zeros(2, 128)).tolist() == [2.0**-22] * 2
    assert fp8_scale(row_with_amax(5e-5)).item() == 2.0**-22
    assert fp8_scale(row_with_amax(1e-30)).item() == 2.0**-22


def _e4m3_half_step(y: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 code spacing at |y| (3 mantissa bits; subnormal spacing 2**-9 below 2**-6)."""
    _, exponent = torch.frexp(y.abs().double())  # |y| = m * 2**exponent, m in [0.5, 1)
    step = torch.pow(2.0, (exponent - 1 - 3).double())
    return torch.where(y.abs() < 2.0**-6, torch.full_like(step, 2.0**-9), step) / 2


def test_fp8_round_trip_within_half_a_code_step():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(400, 1, generator=g, dtype=torch.float64) * 12 - 6)
    x = (torch.randn(400, 128, generator=g, dtype=torch.float64) * magnitude).float()
    values, scale = quantize_fp8(x)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (400,)
    y = x.double() / scale.double().unsqueeze(-1)
    assert y.abs().max() <= 448
    err = (dequantize_fp8(values, scale).double() - x.double()).abs()
    bound = _e4m3_half_step(y) * scale.double().unsqueeze(-1)
    assert bool((err <= bound).all()), seed


def test_fp8_values_are_exact_on_the_grid():
    x = torch.zeros(1, 128)
    x[0, :6] = torch.tensor([448.0, -448.0, 1.0, -0.5, 3.5, 2.0**-9])  # amax 448 -> scale 1
    values, scale = quantize_fp8(x)
    assert scale.item() == 1.0
    assert values.float()[0, :6].tolist() == [448.0, -448.0, 1.0, -0.5, 3.5, 2.0**-9]


def test_fp8_non_finite_rules():
    x = torch.zeros(1, 128)
    x[0, :4] = torch.tensor([math.inf, -math.inf, math.nan, 1.0])
    values, scale = quantize_fp8(x)
    # amax over finite elements only: 1.0 -> 2**ceil(log2(1/448)) = 2**-8
    assert scale.item() == 2.0**-8
    codes = values.view(torch.uint8)[0, :4].tolist()
    assert codes[0] == 0x7E  # +448, the largest finite e4m3 code
    assert codes[1] == 0xFE  # -448
    assert codes[2] & 0x7F == 0x7F  # e4m3 NaN
    assert dequantize_fp8(values, scale)[0, 3].item() == 1.0


def test_fp8_all_non_finite_token():
    x = torch.full((1, 128), math.inf)
    x[0, 1] = math.nan
    values, scale = quantize_fp8(x)
    assert scale.item() == 2.0**-22  # amax 0 -> the 1e-4 floor
    assert values.view(torch.uint8)[0, 0].item() == 0x7E


# --- MXFP4 ----------------------------------------------------------------------------------


def test_mxfp4_scale_random_magnitudes():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    tokens = 1500
    magnitude = 10.0 ** (torch.rand(tokens, 4, 1, generator=g, dtype=torch.float64) * 72 - 36)
    x = (torch.randn(tokens, 4, 32, generator=g, dtype=torch.float64) * magnitude).float().flatten(-2)
    _, scale_bytes = quantize_mxfp4(x)
    assert scale_bytes.dtype == torch.uint8 and scale_bytes.shape == (tokens, 4)
    amax = x.unflatten(-1, (4, 32)).abs().amax(-1).tolist()
    got = scale_bytes.tolist()
    exps = mxfp4_scale_exponent(x).tolist()
    for i in range(tokens):
        for j in range(4):
            assert got[i][j] == spec_mxfp4_byte(amax[i][j]), (seed, i, j, amax[i][j])
            assert exps[i][j] == got[i][j] - 127


@pytest.mark.parametrize("k", [-120, -40, -9, -1, 0, 1, 5, 60, 120])
def test_mxfp4_scale_at_power_of_two_boundaries(k):
    boundary = 6.0 * 2.0**k
    for amax, exponent in [(boundary, k), (next_down(boundary), k), (next_up(boundary), k + 1)]:
        x = row_with_amax(amax, 32)
        assert quantize_mxfp4(x)[1].item() == exponent + 127, amax


def test_mxfp4_all_zero_group_scale_byte_zero():
    x = torch.zeros(2, 128)
    x[0, 40] = 3.0  # only group 1 of token 0 is non-zero
    packed, scales = quantize_mxfp4(x)
    assert scales.tolist() == [[0, 126, 0, 0], [0, 0, 0, 0]]  # 3 / 6 = 0.5 -> 2**-1 -> 126
    assert packed[1].tolist() == [0] * 64


def _group(values, lead=6.0):
    """One 32-value group led by ``lead`` (scale 1 when lead is 6), padded with zeros."""
    x = torch.zeros(32)
    x[0] = lead
    x[1:1 + len(values)] = torch.tensor(values)
    return x


def _codes(packed: torch.Tensor) -> list[int]:
    """Unpack by hand: element 2i is the low nibble of byte i, 2i+1 the high nibble."""
    out = []
    for byte in packed.flatten().tolist():
        out += [byte & 0xF, byte >> 4]
    return out


# midpoint -> the code with the even index (ties to even): 0.25->0, 0.75->1.0, 1.25->1.0,
# 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0
MIDPOINTS = [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)]


@pytest.mark.parametrize("scale_exp", [0, 3, -4])
def test_mxfp4_ties_to_even_at_every_midpoint(scale_exp):
    s = 2.0**scale_exp
    values = [m * s for m, _ in MIDPOINTS] + [-m * s for m, _ in MIDPOINTS]
    packed, scales = quantize_mxfp4(_group(values, lead=6.0 * s))
    assert scales.item() == 127 + scale_exp
    codes = _codes(packed)[1:1 + len(values)]
    assert codes == [c for _, c in MIDPOINTS] + [c | 8 for _, c in MIDPOINTS]


def test_mxfp4_one_ulp_off_the_midpoints():
    above = [next_up(m) for m, _ in MIDPOINTS]
    below = [next_down(m) for m, _ in MIDPOINTS]
    packed, _ = quantize_mxfp4(_group(above + below))
    codes = _codes(packed)[1:15]
    # just above a midpoint rounds up to the upper neighbour, just below to the lower one
    assert codes[:7] == [1, 2, 3, 4, 5, 6, 7]
    assert codes[7:] == [0, 1, 2, 3, 4, 5, 6]


def test_mxfp4_grid_values_zeros_and_extremes():
    values = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0, 0.0, -0.0, -0.1, 0.1, -0.5]
    packed, scales = quantize_mxfp4(_group(values))
    assert scales.item() == 127
    codes = _codes(packed)[:1 + len(values)]
    assert codes == [7, 1, 2, 3, 4, 5, 6, 7, 15, 0, 8, 8, 0, 9]  # -0.0 and -0.1 store as -0 (0x8)


def test_e2m1_encode_saturates_beyond_six():
    y = torch.tensor([6.0, 6.5, 7.0, 100.0, 1e30, math.inf, -6.5, -1e30, -math.inf, math.nan])
    assert e2m1_encode(y).tolist() == [7, 7, 7, 7, 7, 7, 15, 15, 15, 0]


def test_mxfp4_non_finite_rules():
    x = torch.zeros(32)
    x[:5] = torch.tensor([math.inf, -math.inf, math.nan, 1.0, -0.5])
    packed, scales = quantize_mxfp4(x)
    # amax over finite elements: 1.0 -> 2**ceil(log2(1/6)) = 2**-2; 1.0 / 0.25 = 4, -0.5 / 0.25 = -2
    assert scales.item() == 125
    assert _codes(packed)[:5] == [7, 15, 0, 6, 12]
    all_bad = torch.tensor([math.inf, math.nan] * 16)
    packed, scales = quantize_mxfp4(all_bad)
    assert scales.item() == 0
    assert _codes(packed)[:2] == [7, 0]


def test_mxfp4_nibble_order():
    # codes 7, 1 | 2, 3 | 4, 5 | 6, 0 | 9, 15 -> bytes 0x17, 0x32, 0x54, 0x06, 0xF9
    x = _group([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0, -0.5, -6.0], lead=6.0)
    packed, _ = quantize_mxfp4(x)
    assert packed[:5].tolist() == [0x17, 0x32, 0x54, 0x06, 0xF9]
    assert packed.shape == (16,)


def test_mxfp4_round_trip_within_half_a_code_step():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(300, 4, 1, generator=g, dtype=torch.float64) * 40 - 20)
    x = (torch.randn(300, 4, 32, generator=g, dtype=torch.float64) * magnitude).float().flatten(-2)
    packed, scales = quantize_mxfp4(x)
    assert packed.shape == (300, 64)
    out = dequantize_mxfp4(packed, scales).double().unflatten(-1, (4, 32))
    s = torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    groups = x.double().unflatten(-1, (4, 32))
    y = (groups / s).abs()
    assert y.max() <= 6
    half_step = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))
    assert bool(((out - groups).abs() <= half_step * s).all()), seed


def test_mxfp4_needs_groups_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(1, 48))


# --- page views over a strided pool ---------------------------------------------------------


def _pool(num_pages, stride):
    return torch.full((num_pages * stride,), SENTINEL, dtype=torch.uint8)


def _pages(pool, num_pages, stride, entry, offset):
    return pool.as_strided((num_pages, 64, entry), (stride, entry, 1), offset)


def test_fp8_page_views_alias_a_strided_pool():
    num_pages, stride, offset = 3, 64 * 300, 64 * 100  # a layer's pages inside wider sub-rows
    pool = _pool(num_pages, stride)
    pages = _pages(pool, num_pages, stride, 132, offset)
    values, scales = fp8_page_views(pages, 128)
    assert values.shape == (3, 64, 128) and values.dtype == torch.float8_e4m3fn
    assert scales.shape == (3, 64) and scales.dtype == torch.float32
    assert values.stride() == (stride, 128, 1)
    x = torch.randn(3, 64, 128) * 3
    q, s = quantize_fp8(x)
    values.copy_(q)
    scales.copy_(s)
    expected = torch.full_like(pool, SENTINEL)
    for p in range(num_pages):
        base = p * stride + offset
        for t in range(64):
            expected[base + 128 * t: base + 128 * t + 128] = q[p, t].view(torch.uint8)
            scale_at = base + 64 * 128 + 4 * t  # all values first, then the 64 fp32 scales
            expected[scale_at: scale_at + 4] = torch.tensor(list(struct.pack("<f", s[p, t].item())),
                                                            dtype=torch.uint8)
    assert torch.equal(pool, expected)  # and nothing outside the pages was touched
    assert torch.equal(dequantize_pages(pages, 128, "fp8"), dequantize_fp8(q, s))
    assert torch.equal(dequantize_pages(pages, 128, "auto"), dequantize_fp8(q, s))


def test_fp8_page_views_read_what_the_pool_holds():
    stride, offset = 64 * 300, 64 * 132
    pool = _pool(2, stride)
    pages = _pages(pool, 2, stride, 132, offset)
    # token 5 of page 1: value 0 = 1.0 (e4m3 0x38), scale 0.5
    at = stride + offset
    pool[at + 5 * 128] = 0x38
    pool[at + 8192 + 20: at + 8192 + 24] = torch.tensor(list(struct.pack("<f", 0.5)), dtype=torch.uint8)
    values, scales = fp8_page_views(pages, 128)
    assert values[1, 5, 0].float().item() == 1.0
    assert scales[1, 5].item() == 0.5
    assert dequantize_pages(pages, 128, "fp8")[1, 5, 0].item() == 0.5


def test_mxfp4_page_views_alias_a_strided_pool():
    num_pages, stride, offset = 2, 64 * 250, 64 * 132
    pool = _pool(num_pages, stride)
    pages = _pages(pool, num_pages, stride, 68, offset)
    packed_view, scale_view = mxfp4_page_views(pages, 128)
    assert packed_view.shape == (2, 64, 64) and scale_view.shape == (2, 64, 4)
    assert packed_view.stride() == (stride, 64, 1) and scale_view.stride() == (stride, 4, 1)
    x = torch.randn(2, 64, 128)
    packed, scales = quantize_mxfp4(x)
    packed_view.copy_(packed)
    scale_view.copy_(scales)
    expected = torch.full_like(pool, SENTINEL)
    for p in range(num_pages):
        base = p * stride + offset
        for t in range(64):
            expected[base + 64 * t: base + 64 * t + 64] = packed[p, t]
            expected[base + 4096 + 4 * t: base + 4096 + 4 * t + 4] = scales[p, t]
    assert torch.equal(pool, expected)
    assert torch.equal(dequantize_pages(pages, 128, "mxfp4"), dequantize_mxfp4(packed, scales))


def test_page_view_checks():
    pool = _pool(2, 64 * 300)
    with pytest.raises(ValueError, match="uint8 view"):
        indexer_pages_format(pool.view(torch.int8).as_strided((2, 64, 132), (19200, 132, 1)), 128, "fp8")
    with pytest.raises(ValueError, match=r"130 B a token do not hold fp8 keys of head_dim=128 \(132 B"):
        indexer_pages_format(_pages(pool, 2, 64 * 300, 130, 0), 128, "fp8")
    with pytest.raises(ValueError, match=r"132 B a token do not hold mxfp4 keys of head_dim=128 \(68 B"):
        indexer_pages_format(_pages(pool, 2, 64 * 300, 132, 0), 128, "mxfp4")
    with pytest.raises(ValueError, match=r"match no key format at head_dim=128; allowed widths: 132 \(fp8\), 68"):
        indexer_pages_format(_pages(pool, 2, 64 * 300, 130, 0), 128)
    with pytest.raises(ValueError, match="overlaps"):
        indexer_pages_format(pool.as_strided((2, 64, 132), (64 * 100, 132, 1)), 128, "fp8")
    with pytest.raises(ValueError, match="contiguous"):
        indexer_pages_format(pool.as_strided((2, 64, 132), (64 * 300, 133, 1)), 128, "fp8")
    with pytest.raises(ValueError, match="indexer_kv_dtype='int4'"):
        dequantize_pages(_pages(pool, 2, 64 * 300, 132, 0), 128, "int4")


def test_page_format_is_read_off_the_entry_width():
    pool = _pool(2, 64 * 300)
    assert indexer_pages_format(_pages(pool, 2, 64 * 300, 132, 0), 128).name == "fp8"
    assert indexer_pages_format(_pages(pool, 2, 64 * 300, 68, 0), 128).name == "mxfp4"
    assert indexer_pages_format(_pages(pool, 2, 64 * 300, 68, 0), 64).name == "fp8"  # 64 + 4
    assert indexer_pages_format(_pages(pool, 2, 64 * 300, 132, 0), 128, "auto").name == "fp8"
    with pytest.raises(ValueError, match="index_head_dim=48 must be a multiple of 32"):
        indexer_pages_format(_pages(pool, 2, 64 * 300, 25, 0), 48, "mxfp4")
    with pytest.raises(ValueError, match=r"allowed widths: 52 \(fp8\)$"):
        indexer_pages_format(_pages(pool, 2, 64 * 300, 25, 0), 48)
