"""Indexer logits: Triton (interpreter on CPU, compiled on CUDA) against the PyTorch reference,
the reference against closed-form values, and the masking rules of ``paged_decode_logits``."""


import pytest
import torch

from dsacache.formats.indexer_key import fp8_page_views, mxfp4_page_views, quantize_fp8, quantize_mxfp4
from dsacache.formats.key_format import IndexerKeyFormat, indexer_entry_bytes
from dsacache.formats.sizes import KERNEL_PAGE_SIZE
from dsacache.ops.indexer_logits import (
    paged_decode_logits,
    per_row_context_lens,
    prefill_row_chunks,
    ragged_prefill_logits,
)
from tests.helpers import calc_diff, run_compiled_script, triton_available

D = 128
SENTINEL = 0xA5
#: calc-diff bounds the issue sets for logits against the reference, by key format.
TOLERANCE = {"fp8": 1e-3, "mxfp4": 2e-2}
#: What the kernels actually reach on the same quantized keys (the Triton kernels differ in
#: the fp32 summation order, ~1e-9; the Gluon decodes round relu(q.k) to bf16 for their
#: head-sum wgmma, ~2e-7 at H = 32; no MXFP4 group is dropped for Gaussian keys); far below
#: TOLERANCE, so a wrong code in one e2m1 magnitude still fails.
STRICT = 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8, MXFP4 = IndexerKeyFormat("fp8", D), IndexerKeyFormat("mxfp4", D)
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not triton_available(), reason="no triton"))]


def quantize(fmt, keys):
    return (quantize_fp8 if fmt == "fp8" else quantize_mxfp4)(keys)


def views(fmt, pages):
    return (fp8_page_views if fmt == "fp8" else mxfp4_page_views)(pages, D)


def make_pool(fmt, num_pages, device=DEVICE, keys=None):
    """(pool, pages): the layer's pages sit at the second of three page slots per pool row,
    every other byte is SENTINEL; the pages hold quantized ``keys`` (random by default)."""
    entry = indexer_entry_bytes(D, fmt)
    pool = torch.full((num_pages, 3, KERNEL_PAGE_SIZE * entry), SENTINEL, dtype=torch.uint8, device=device)
    pages = pool[:, 1].view(num_pages, KERNEL_PAGE_SIZE, entry)
    if keys is None:
        keys = torch.randn(num_pages, KERNEL_PAGE_SIZE, D, device=device)
    values, scales = views(fmt, pages)
    values[:], scales[:] = quantize(fmt, keys)
    return pool, pages


def random_queries(batch, next_n, heads, device=DEVICE):
    q = torch.randn(batch, next_n, heads, D, device=device).to(torch.float8_e4m3fn)
    return q, torch.rand(batch * next_n, heads, device=device) * heads**-0.5


def decode(impl, q, w, lens, pages, table, max_model_len, fmt):
    """Run into a NaN-prefilled output so unwritten elements show."""
    out = torch.full((q.shape[0] * q.shape[1], max_model_len), float("nan"), device=q.device)
    result = paged_decode_logits(q, w, lens, pages, table, max_model_len, fmt, out=out, impl=impl)
    assert result.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any(), "unwritten (NaN) logits"
    return out


def assert_close_to_reference(out, ref, fmt):
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), "-inf pattern differs"
    assert calc_diff(out, ref) < min(STRICT, TOLERANCE[fmt])


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("next_n,heads", [(1, 16), (3, 16), (2, 32)])
def test_decode_triton_matches_reference(fmt, next_n, heads):
    pytest.importorskip("triton")
    batch, num_pages, max_model_len = 3, 14, 330
    pool, pages = make_pool(fmt, num_pages)
    before = pool.clone()
    q, w = random_queries(batch, next_n, heads)
    table = torch.randperm(num_pages, device=DEVICE)[:12].view(batch, 4).to(torch.int32)
    seq_lens = torch.tensor([130, 256, 1], dtype=torch.int32, device=DEVICE)
    lens = per_row_context_lens(seq_lens, next_n)
    out = decode("triton", q, w, lens, pages, table, max_model_len, fmt)
    ref = decode("torch", q, w, lens, pages, table, max_model_len, fmt)
    assert_close_to_reference(out, ref, fmt)
    assert torch.equal(pool, before), "the read path wrote into the pool"


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("next_n", [2, 3, 4])
@pytest.mark.parametrize("split", [True, False])
def test_decode_one_product_per_row_matches_reference(fmt, next_n, split):
    """The Triton decode's split path (one product per query row) and its joint one, forced at any
    head count (and on Hopper too), with per-request lengths (each row masked at its own length)."""
    pytest.importorskip("triton")
    from dsacache.ops.indexer_logits.launch import launch_paged_decode

    batch, num_pages, max_model_len = 2, 10, 260
    _, pages = make_pool(fmt, num_pages)
    q, w = random_queries(batch, next_n, 16)
    table = torch.randperm(num_pages, device=DEVICE)[:8].view(batch, 4).to(torch.int32)
    seq_lens = torch.tensor([131, 3], dtype=torch.int32, device=DEVICE)
    out = torch.full((batch * next_n, max_model_len), float("nan"), device=DEVICE)
    values, scales = views(fmt, pages)
    launch_paged_decode(q, w, seq_lens, values, scales, table, out, IndexerKeyFormat(fmt, D),
                        {"kernel": "triton", "split_rows": {next_n: 1} if split else {}})
    ref = decode("torch", q, w, per_row_context_lens(seq_lens, next_n), pages, table, max_model_len, fmt)
    assert not torch.isnan(out).any(), "unwritten (NaN) logits"
    assert_close_to_reference(out, ref, fmt)


def closed_form_keys(num_pages):
    """Key value at (page, row, d): 2**(((page * 64 + row) + d // 32) % 8 - 4), exact in both formats."""
    token = torch.arange(num_pages * KERNEL_PAGE_SIZE).view(num_pages, KERNEL_PAGE_SIZE, 1)
    group = torch.arange(D).view(1, 1, D) // 32
    return torch.ldexp(torch.ones(()), ((token + group) % 8 - 4).float())


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_exact_closed_form(fmt, impl):
    """Power-of-two keys, queries of +-1, a scrambled block table and a length of 130."""
    heads, num_pages, length = 16, 9, 130
    _, pages = make_pool(fmt, num_pages, keys=closed_form_keys(num_pages).to(DEVICE))
    table = torch.tensor([[7, 2, 5, 0]], dtype=torch.int32, device=DEVICE)
    q = torch.ones(1, 1, heads, D, device=DEVICE)
    q[:, :, 1::2] = -1.0  # negative dot products: relu drops these heads
    q = q.to(torch.float8_e4m3fn)
    w = torch.full((1, heads), 1.0 / heads, device=DEVICE)
    lens = torch.tensor([[length]], dtype=torch.int32, device=DEVICE)
    out = decode(impl, q, w, lens, pages, table, 256, fmt).cpu()

    pos = torch.arange(length)
    page = torch.tensor([7, 2, 5])[pos // KERNEL_PAGE_SIZE]
    token = (page * KERNEL_PAGE_SIZE + pos % KERNEL_PAGE_SIZE)[:, None]
    dot = sum(32 * torch.ldexp(torch.ones(()), ((token + g) % 8 - 4).float()) for g in range(4))
    expected = dot.squeeze(1) * (heads // 2) / heads
    assert torch.equal(out[0, :length], expected)
    assert torch.isneginf(out[0, length:]).all()


def test_mxfp4_group_far_below_its_token_is_dropped():
    """The Triton path drops a group more than 2**11 below its token's largest group
    (documented in mxfp4_e4m3.py); otherwise it matches the reference."""
    pytest.importorskip("triton")
    keys = torch.randn(2, KERNEL_PAGE_SIZE, D, device=DEVICE)
    keys[..., 96:] *= 2.0**-16
    _, pages = make_pool("mxfp4", 2, keys=keys)
    _, without = make_pool("mxfp4", 2, keys=torch.cat([keys[..., :96], torch.zeros_like(keys[..., 96:])], -1))
    q, w = random_queries(1, 1, 16)
    table = torch.tensor([[1, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([[128]], dtype=torch.int32, device=DEVICE)
    out = decode("triton", q, w, lens, pages, table, 128, "mxfp4")
    assert calc_diff(out, decode("torch", q, w, lens, without, table, 128, "mxfp4")) < STRICT
    assert calc_diff(out, decode("torch", q, w, lens, pages, table, 128, "mxfp4")) < TOLERANCE["mxfp4"]


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_rows_masked_at_their_own_length(impl):
    next_n, heads = 3, 16
    _, pages = make_pool("fp8", 6)
    q, w = random_queries(2, next_n, heads)
    table = torch.tensor([[3, 1, 4], [0, 5, 2]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([[130, 5, 64], [0, 192, 191]], dtype=torch.int32, device=DEVICE)
    out = decode(impl, q, w, lens, pages, table, 200, "fp8")
    for row, length in enumerate(lens.flatten().tolist()):
        assert torch.isfinite(out[row, :length]).all(), row
        assert torch.isneginf(out[row, length:]).all(), row


@pytest.mark.parametrize("impl", IMPLS)
def test_per_request_lengths_expand_to_rows(impl):
    seq_lens = torch.tensor([10, 1, 0], dtype=torch.int32, device=DEVICE)
    expected = torch.tensor([[8, 9, 10], [0, 0, 1], [0, 0, 0]], dtype=torch.int32, device=DEVICE)
    assert torch.equal(per_row_context_lens(seq_lens, 3), expected)
    _, pages = make_pool("fp8", 2)
    q, w = random_queries(3, 3, 16)
    table = torch.tensor([[0], [1], [0]], dtype=torch.int32, device=DEVICE)
    by_request = decode(impl, q, w, seq_lens, pages, table, 16, "fp8")
    by_row = decode(impl, q, w, expected, pages, table, 16, "fp8")
    assert torch.equal(by_request, by_row)
    assert torch.equal(torch.isfinite(by_row[:, :12]).sum(dim=1).cpu(), expected.flatten().cpu())


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_unreadable_pages_are_neg_inf(impl):
    """Entries -1 or >= num_pages, and blocks past the table, give -inf and never fault."""
    num_pages, heads = 4, 16
    _, pages = make_pool("fp8", num_pages)
    q, w = random_queries(2, 1, heads)
    table = torch.tensor([[2, -1, 1_000_000], [1, 3, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([[192], [250]], dtype=torch.int32, device=DEVICE)
    out = decode(impl, q, w, lens, pages, table, 300, "fp8")
    assert torch.isfinite(out[0, :64]).all()
    assert torch.isneginf(out[0, 64:]).all()
    assert torch.isfinite(out[1, :192]).all(), "row 1 reads 3 pages"
    assert torch.isneginf(out[1, 192:]).all(), "blocks past the 3-entry table are unreadable"


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_empty_pool_is_neg_inf(fmt, impl):
    """A layer view of zero pages: every entry is past the pool, so every logit is -inf."""
    _, pages = make_pool(fmt, 0)
    q, w = random_queries(2, 2, 16)
    table = torch.tensor([[0, 1], [-1, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([[100, 101], [5, 6]], dtype=torch.int32, device=DEVICE)
    assert torch.isneginf(decode(impl, q, w, lens, pages, table, 130, fmt)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_lengths_clamped(impl):
    _, pages = make_pool("fp8", 3)
    q, w = random_queries(2, 1, 16)
    table = torch.tensor([[0, 1, 2], [2, 1, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([[-5], [10_000]], dtype=torch.int32, device=DEVICE)
    out = decode(impl, q, w, lens, pages, table, 100, "fp8")
    assert torch.isneginf(out[0]).all()
    assert torch.isfinite(out[1]).all()


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_prefill_triton_matches_reference(fmt):
    pytest.importorskip("triton")
    num_keys, rows, heads = 333, 9, 16
    values, scales = quantize(fmt, torch.randn(num_keys, D, device=DEVICE))
    q = torch.randn(rows, heads, D, device=DEVICE).to(torch.float8_e4m3fn)
    w = torch.rand(rows, heads, device=DEVICE)
    ks = torch.tensor([0, 0, 5, 70, 100, 332, 50, 300, 0], dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([1, 333, 150, 70, 333, 333, 60, 900, 0], dtype=torch.int32, device=DEVICE)
    results = []
    for impl in ("triton", "torch"):
        out = torch.full((rows, num_keys), float("nan"), device=DEVICE)
        ragged_prefill_logits(q, w, values, scales, ks, ke, out=out, impl=impl)
        assert not torch.isnan(out).any()
        results.append(out)
    assert_close_to_reference(*results, fmt)
    cols = torch.arange(num_keys, device=DEVICE)
    inside = (cols >= ks[:, None]) & (cols < ke[:, None])
    assert torch.equal(torch.isfinite(results[0]), inside)


def unaligned_copy(t):
    """``t`` copied to a uint8 buffer one byte past a 4-byte boundary (same shape and strides)."""
    flat = torch.zeros(t.numel() + 4, dtype=torch.uint8, device=t.device)
    moved = flat[1:1 + t.numel()].view(t.shape)
    moved.copy_(t)
    return moved


def test_mxfp4_unaligned_keys_take_the_byte_decode():
    """MXFP4 key rows that are not 4-byte aligned are decoded a byte at a time (the table decode
    reads words); decode and prefill still match the reference."""
    pytest.importorskip("triton")
    from dsacache.ops.indexer_logits.launch import _words_aligned

    _, aligned = make_pool("mxfp4", 5)
    pages = unaligned_copy(aligned.contiguous())
    assert not _words_aligned(views("mxfp4", pages)[0])
    q, w = random_queries(2, 2, 16)
    table = torch.tensor([[4, 0, 2], [1, 3, -1]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([[150, 151], [65, 66]], dtype=torch.int32, device=DEVICE)
    out = decode("triton", q, w, lens, pages, table, 200, "mxfp4")
    assert_close_to_reference(out, decode("torch", q, w, lens, aligned, table, 200, "mxfp4"), "mxfp4")

    values, scales = quantize("mxfp4", torch.randn(130, D, device=DEVICE))
    values = unaligned_copy(values)
    assert not _words_aligned(values)
    q = q.flatten(0, 1)
    ks = torch.tensor([0, 3, 64, 129], dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([130, 70, 65, 130], dtype=torch.int32, device=DEVICE)
    out = ragged_prefill_logits(q, w, values, scales, ks, ke, impl="triton")
    assert_close_to_reference(out, ragged_prefill_logits(q, w, values, scales, ks, ke, impl="torch"), "mxfp4")


def test_prefill_reference_is_decode_math():
    """The same keys scored through pages (decode) and contiguously (prefill) agree."""
    _, pages = make_pool("fp8", 2, device="cpu")
    values, scales = fp8_page_views(pages, D)
    q, w = random_queries(1, 1, 16, device="cpu")
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    decoded = paged_decode_logits(q, w, torch.tensor([[128]], dtype=torch.int32), pages, table, 128, impl="torch")
    ks, ke = torch.tensor([0], dtype=torch.int32), torch.tensor([128], dtype=torch.int32)
    prefilled = ragged_prefill_logits(q[0], w, values.reshape(-1, D), scales.reshape(-1), ks, ke, impl="torch")
    assert torch.equal(decoded, prefilled)


def test_prefill_row_chunks():
    assert prefill_row_chunks(10, 100, 4 * 100 * 3) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert prefill_row_chunks(2, 10**9, 16) == [(0, 1), (1, 2)]
    assert prefill_row_chunks(0, 5, 64) == []


def small_cpu_case():
    """(pages, q, w, table, lens): one FP8 request of 10 tokens on CPU, for the argument checks."""
    _, pages = make_pool("fp8", 2, device="cpu")
    q, w = random_queries(1, 1, 16, device="cpu")
    return pages, q, w, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([[10]], dtype=torch.int32)


def test_validation_names_the_argument():
    pages, q, w, table, lens = small_cpu_case()
    with pytest.raises(ValueError, match="q must be"):
        paged_decode_logits(q.float(), w, lens, pages, table, 64)
    with pytest.raises(ValueError, match="weights"):
        paged_decode_logits(q, w[:, :8], lens, pages, table, 64)
    with pytest.raises(ValueError, match="block_table"):
        paged_decode_logits(q, w, lens, pages, table.long(), 64)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_logits(q, w, lens.view(1, 1, 1), pages, table, 64)
    with pytest.raises(ValueError, match="mxfp4"):
        paged_decode_logits(q, w, lens, pages, table, 64, indexer_kv_dtype="mxfp4")
    with pytest.raises(ValueError, match="impl"):
        paged_decode_logits(q, w, lens, pages, table, 64, impl="cuda")
    with pytest.raises(ValueError, match="out must be"):
        paged_decode_logits(q, w, lens, pages, table, 64, out=torch.empty(1, 63))
    with pytest.raises(ValueError, match="k_values"):
        ragged_prefill_logits(q[0], w, torch.zeros(4, D), torch.ones(4), lens[0], lens[0])


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("impl", IMPLS)
def test_decode_reads_the_format_off_the_pages(fmt, impl):
    """Without ``indexer_kv_dtype`` the format comes from the pages (the pool's entry width); the
    name, or an IndexerKeyFormat, gives the same logits bit for bit."""
    _, pages = make_pool(fmt, 5)
    q, w = random_queries(2, 2, 16)
    table = torch.tensor([[4, 0, 2], [1, 3, -1]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([[150, 151], [65, 66]], dtype=torch.int32, device=DEVICE)
    named = decode(impl, q, w, lens, pages, table, 200, fmt)
    for given in (None, IndexerKeyFormat(fmt, D)):
        assert torch.equal(decode(impl, q, w, lens, pages, table, 200, given), named)


def test_decode_wrong_format_is_refused_clearly():
    """A format the pages do not hold, an unknown name or a format of another key width: a
    ValueError naming it, before anything is written."""
    pages, q, w, table, lens = small_cpu_case()
    out = torch.full((1, 64), float("nan"))
    cases = [("mxfp4", r"do not hold mxfp4 keys of head_dim=128"),
             ("bf16", r"indexer_kv_dtype='bf16' is not supported; allowed: auto, fp8, mxfp4"),
             (IndexerKeyFormat("fp8", 64), r"head_dim=64, keys have 128"),
             (8, r"indexer_kv_dtype must be a string")]
    for given, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_decode_logits(q, w, lens, pages, table, 64, given, out=out)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_reads_the_format_off_the_dtypes(impl):
    """FP8 keys (e4m3 values, float32 scales) and MXFP4 keys (uint8 values and scale bytes) need
    no format argument; mixed or misshapen pairs are refused naming k_values and k_scales."""
    q = torch.randn(3, 16, D, device=DEVICE).to(torch.float8_e4m3fn)
    w = torch.rand(3, 16, device=DEVICE)
    ks = torch.tensor([0, 10, 64], dtype=torch.int32, device=DEVICE)
    ke = torch.tensor([100, 65, 100], dtype=torch.int32, device=DEVICE)
    keys = torch.randn(100, D, device=DEVICE)
    fp8, mxfp4 = quantize_fp8(keys), quantize_mxfp4(keys)
    for values, scales in (fp8, mxfp4):
        out = ragged_prefill_logits(q, w, values, scales, ks, ke, impl=impl)
        ref = ragged_prefill_logits(q, w, values, scales, ks, ke, impl="torch")
        assert torch.equal(torch.isneginf(out), torch.isneginf(ref)) and calc_diff(out, ref) < STRICT
    for values, scales in ((fp8[0], mxfp4[1]), (mxfp4[0], fp8[1]), (mxfp4[0][:, :32], mxfp4[1])):
        with pytest.raises(ValueError, match="keys must be k_values .* and k_scales"):
            ragged_prefill_logits(q, w, values, scales, ks, ke, impl=impl)
    with pytest.raises(ValueError, match="multiple of 32"):
        ragged_prefill_logits(q[..., :48], w, mxfp4[0][:, :24], mxfp4[1][:, :1], ks, ke, impl="torch")


def test_arguments_of_the_wrong_type_are_refused():
    pages, q, w, table, lens = small_cpu_case()
    with pytest.raises(ValueError, match="q must be a torch.Tensor"):
        paged_decode_logits(q.tolist(), w, lens, pages, table, 64)
    with pytest.raises(ValueError, match="context_lens must be a torch.Tensor"):
        paged_decode_logits(q, w, [10], pages, table, 64)
    with pytest.raises(ValueError, match="block_table must be an int32 tensor"):
        paged_decode_logits(q, w, lens, pages, [[0, 0]], 64)
    for bad in (64.0, True, "64", 0):
        with pytest.raises(ValueError, match="max_model_len"):
            paged_decode_logits(q, w, lens, pages, table, bad)
    with pytest.raises(ValueError, match="k_scales must be a torch.Tensor"):
        ragged_prefill_logits(q[0], w, *quantize_fp8(torch.randn(4, D))[:1], None, lens[0], lens[0])
    with pytest.raises(ValueError, match="next_n"):
        per_row_context_lens(lens[0], 1.5)
    with pytest.raises(ValueError, match="seq_lens"):
        per_row_context_lens(lens, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_decode_gpu_shapes(fmt, heads, next_n):
    batch, num_pages, max_model_len = 8, 700, 40_000
    pool, pages = make_pool(fmt, num_pages, device="cuda")
    before = pool.clone()
    q, w = random_queries(batch, next_n, heads, device="cuda")
    table = torch.randint(0, num_pages, (batch, 640), dtype=torch.int32, device="cuda")
    table[1, 5] = -1
    table[2, 7] = num_pages
    seq_lens = torch.tensor([1, 63, 64, 65, 4097, 20_000, 40_000, 39_999], dtype=torch.int32, device="cuda")
    lens = per_row_context_lens(seq_lens, next_n)
    out = decode("triton", q, w, lens, pages, table, max_model_len, fmt)
    ref = decode("torch", q, w, lens, pages, table, max_model_len, fmt)
    assert_close_to_reference(out, ref, fmt)
    assert torch.equal(pool, before)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("heads", [32, 64])
def test_prefill_gpu_shapes(fmt, heads):
    num_keys, rows = 5000, 300
    values, scales = quantize(fmt, torch.randn(num_keys, D, device="cuda"))
    q = torch.randn(rows, heads, D, device="cuda").to(torch.float8_e4m3fn)
    w = torch.rand(rows, heads, device="cuda")
    ke = torch.randint(0, num_keys + 1, (rows,), dtype=torch.int32, device="cuda")
    ks = (ke - torch.randint(0, 3000, (rows,), device="cuda")).clamp_min(0).to(torch.int32)
    out = ragged_prefill_logits(q, w, values, scales, ks, ke, impl="triton")
    ref = ragged_prefill_logits(q, w, values, scales, ks, ke, impl="torch")
    assert_close_to_reference(out, ref, fmt)


def require_hopper(what):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip(f"the Gluon {what} decode is built for Hopper")


def gluon_decode_case(fmt, next_n, heads, per_row):
    """Inputs for the Gluon decode tests: 6 requests over 300 pages, block-table entries that
    are -1, one past the pool and far past it, a table 40 positions short of the longest row,
    and lengths 1, 64, 65, a partial last program and the full 9000 columns (per request),
    or ragged per-row lengths (``per_row``)."""
    batch, num_pages, max_model_len = 6, 300, 9000
    pool, pages = make_pool(fmt, num_pages, device="cuda")
    q, w = random_queries(batch, next_n, heads, device="cuda")
    table = torch.randint(0, num_pages, (batch, 140), dtype=torch.int32, device="cuda")
    table[0, 0], table[3, 100], table[2, 5] = -1, num_pages, 10**6
    if per_row:
        lens = torch.randint(0, max_model_len + 1, (batch, next_n), dtype=torch.int32, device="cuda")
        lens[0, 0], lens[1, -1], lens[2, 0] = 1, 65, max_model_len
    else:
        lens = torch.tensor([1, 64, 65, 8191, 9000, 130], dtype=torch.int32, device="cuda")
    return pool, pages, q, w, table, lens, max_model_len


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
def test_mxfp4_gluon_decode_runs_and_agrees_with_triton(heads, next_n):
    """On Hopper the default MXFP4 decode is the Gluon kernel, not a silent fallback, at every
    next_n; it matches the Triton kernel and the reference, -1 and out-of-range pages included,
    with per-request (next_n = 1) and ragged per-row lengths, and leaves the pool untouched."""
    from dsacache.ops.indexer_logits.launch import decode_kernel, launch_paged_decode

    require_hopper("MXFP4")
    pool, pages, q, w, table, lens, max_model_len = gluon_decode_case("mxfp4", next_n, heads, next_n > 1)
    values, scales = views("mxfp4", pages)
    assert decode_kernel(q, values, scales, MXFP4) == "gluon"
    before = pool.clone()
    ref = decode("torch", q, w, lens, pages, table, max_model_len, "mxfp4")
    # The launcher's pages a program on this small grid (4), and the full run (no least grid).
    # next_n 3 also as one product of 4 rows (``gluon_row_split`` empty).
    unsplit = [{"kernel": "gluon", "gluon_row_split": None}] if next_n == 3 else []
    for config in ({"kernel": "gluon"}, {"kernel": "gluon", "gluon_min_programs_per_sm": 0}, *unsplit,
                   {"kernel": "triton"}):
        out = torch.full(ref.shape, float("nan"), device="cuda")
        launch_paged_decode(q, w, lens, values, scales, table, out, MXFP4, config)
        assert_close_to_reference(out, ref, "mxfp4")
    assert torch.equal(pool, before)


@pytest.mark.gpu
def test_mxfp4_gluon_decode_needs_the_pool_page_layout():
    """The Gluon MXFP4 kernel reads a page's scales right after its values; views that are not
    cut from the same pages run the Triton kernel instead, with the same result."""
    from dsacache.ops.indexer_logits.launch import decode_kernel, launch_paged_decode

    require_hopper("MXFP4")
    num_pages, max_model_len = 40, 1000
    _, pages = make_pool("mxfp4", num_pages, device="cuda")
    values, scales = views("mxfp4", pages)
    q, w = random_queries(2, 1, 32, device="cuda")
    table = torch.randint(0, num_pages, (2, 16), dtype=torch.int32, device="cuda")
    lens = torch.tensor([1000, 65], dtype=torch.int32, device="cuda")
    apart = values.clone(), scales.clone()
    assert decode_kernel(q, values, scales, MXFP4) == "gluon"
    assert decode_kernel(q, *apart, MXFP4) == "triton"
    ref = decode("torch", q, w, lens, pages, table, max_model_len, "mxfp4")
    for vals, scls in ((values, scales), apart):
        out = torch.full((2, max_model_len), float("nan"), device="cuda")
        launch_paged_decode(q, w, lens, vals, scls, table, out, MXFP4)
        assert_close_to_reference(out, ref, "mxfp4")


@pytest.mark.gpu
@pytest.mark.parametrize("heads,next_n", [(16, 1), (32, 1), (32, 2), (32, 3), (32, 4), (64, 1), (64, 2), (64, 3),
                                          (64, 4), (128, 1), (128, 2)])
@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_gluon_decode_matches_reference(heads, next_n, per_row):
    """The Gluon FP8 decode (TMA-fed pages), forced at every next_n: the reference and the Triton
    kernel, -1 and out-of-range pages (also one far past the pool), ragged per-row lengths,
    lengths 1, 64, 65 and a partial last program; by default it runs at every next_n."""
    from dsacache.ops.indexer_logits.launch import decode_kernel, launch_paged_decode

    require_hopper("FP8")
    pool, pages, q, w, table, lens, max_model_len = gluon_decode_case("fp8", next_n, heads, per_row)
    values, scales = views("fp8", pages)
    gluon = {"kernel": "gluon"}
    assert decode_kernel(q, values, scales, FP8, gluon) == "gluon"
    assert decode_kernel(q, values, scales, FP8) == "gluon"
    before = pool.clone()
    ref = decode("torch", q, w, lens, pages, table, max_model_len, "fp8")
    # The launcher's pages a program on this small grid (4 for Gluon, 2 for Triton), and the full
    # runs (no least grid); next_n 3 also as one product of 4 rows (``gluon_row_split`` empty).
    unsplit = [{**gluon, "gluon_row_split": None}] if next_n == 3 else []
    for config in (gluon, {**gluon, "gluon_min_programs_per_sm": 0}, *unsplit, {"kernel": "triton"},
                   {"kernel": "triton", "triton_min_programs_per_sm": 0}):
        out = torch.full(ref.shape, float("nan"), device="cuda")
        launch_paged_decode(q, w, lens, values, scales, table, out, FP8, config)
        assert not torch.isnan(out).any(), "unwritten (NaN) logits"
        assert_close_to_reference(out, ref, "fp8")
    assert torch.equal(pool, before)


def test_pages_per_program():
    """Pages a program of the decodes: the setting where the grid has enough programs, halved down to
    the least on a short grid, unchanged where the SM count is unknown."""
    from dsacache.ops.indexer_logits.launch import pages_per_program

    assert pages_per_program(32, 64, 131072, 132, 2, 4) == 32   # 4096 programs
    assert pages_per_program(32, 128, 8192, 132, 2, 4) == 32    # 512
    assert pages_per_program(32, 32, 8192, 132, 2, 4) == 8      # 128 and 256 are under 264
    assert pages_per_program(16, 32, 8192, 132, 2, 4) == 8
    assert pages_per_program(32, 1, 9000, 132, 2, 4) == 4       # never under the least
    assert pages_per_program(8, 1, 9000, 132, 8, 2) == 2
    assert pages_per_program(32, 1, 9000, None, 2, 4) == 32
    assert pages_per_program(32, 1, 9000, 132, 0, 4) == 32


def test_fp8_gluon_settings_by_product_columns():
    """Pages a program, ring and the one-wave rule of the FP8 Gluon decode follow the product's
    columns (next_n rounded up, times H); the overrides replace pages and ring only."""
    from dsacache.ops.indexer_logits.launch import DECODE_CONFIG, fp8_gluon_settings

    assert fp8_gluon_settings(DECODE_CONFIG, 32) == (16, 2, False)     # next_n 1, H = 32
    assert fp8_gluon_settings(DECODE_CONFIG, 64) == (16, 2, False)     # next_n 1 at H = 64, next_n 2 at 32
    assert fp8_gluon_settings(DECODE_CONFIG, 128) == (16, 2, True)     # next_n 2 at H = 64, 3-4 at 32
    assert fp8_gluon_settings(DECODE_CONFIG, 256) == (32, 4, False)
    assert fp8_gluon_settings(DECODE_CONFIG, 512) == (32, 4, False)     # wider than the table: its last entry
    assert fp8_gluon_settings({**DECODE_CONFIG, "fp8_gluon_tiles": 8, "fp8_gluon_stages": 5}, 128) == (8, 5, True)


def test_gluon_product_rows():
    """The Gluon decodes' score products: next_n rounded up to a power of two in one product, next_n 3
    as 2 + 1 rows unless ``gluon_row_split`` is empty."""
    from dsacache.ops.indexer_logits.launch import DECODE_CONFIG, gluon_product_rows

    assert [gluon_product_rows(DECODE_CONFIG, n) for n in (1, 2, 3, 4)] == [(1, 0), (2, 0), (2, 1), (4, 0)]
    unsplit = {**DECODE_CONFIG, "gluon_row_split": None}
    assert [gluon_product_rows(unsplit, n) for n in (1, 2, 3, 4)] == [(1, 0), (2, 0), (4, 0), (4, 0)]


def test_one_wave_tiles():
    """More pages a program only where that fits the grid in one wave of resident programs."""
    from dsacache.ops.indexer_logits.launch import one_wave_tiles

    assert one_wave_tiles(16, 64, 32768, 660, 64) == 64      # 2048 / 1024 programs are over 660; 512 fit
    assert one_wave_tiles(16, 128, 8192, 660, 64) == 32      # 1024 are over, 512 fit
    assert one_wave_tiles(16, 64, 131072, 660, 64) == 16     # 2048 programs even at 64 pages: keep 16
    assert one_wave_tiles(16, 64, 32768, 2048, 64) == 16     # already one wave
    assert one_wave_tiles(16, 64, 32768, 511, 64) == 16      # 512 at 64 pages is one too many
    assert one_wave_tiles(16, 64, 32768, None, 64) == 16     # residency unknown


def test_programs_per_sm():
    """Resident programs an SM from registers (256 a warp at a time), shared memory (plus the 1 KB
    the driver keeps a program) and threads; H200 limits: 65,536 registers, 228 KB, 2,048 threads."""
    from dsacache.ops.triton_utils import programs_per_sm

    h200 = (65536, 233472, 2048)
    assert programs_per_sm(43, 21144, 4, *h200) == 10   # registers: 48 x 32 x 4 = 6,144 a program
    assert programs_per_sm(59, 33944, 4, *h200) == 6    # shared memory: 34,968 a program
    assert programs_per_sm(96, 43296, 4, *h200) == 5    # registers and shared memory alike
    assert programs_per_sm(32, 0, 4, *h200) == 16       # threads
    assert programs_per_sm(255, 0, 16, *h200) == 0      # does not fit at all


@pytest.mark.gpu
@pytest.mark.parametrize("heads,next_n", [(32, 1), (64, 2), (64, 4)])
def test_resident_programs_agree_with_the_driver(heads, next_n):
    """``resident_programs`` of the compiled FP8 Gluon decode equals the CUDA driver's occupancy
    (cuOccupancyMaxActiveBlocksPerMultiprocessor) times the SMs."""
    import ctypes

    from triton.experimental.gluon.language import NVMMASharedLayout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from dsacache.ops.indexer_logits.decode_gluon import paged_decode_fp8_kernel
    from dsacache.ops.triton_utils import resident_programs

    require_hopper("FP8")
    pool, pages, q, w, table, lens, max_model_len = gluon_decode_case("fp8", next_n, heads, False)
    values, scales = views("fp8", pages)
    out = torch.empty(q.shape[0] * next_n, max_model_len, device="cuda")
    k_desc = TensorDescriptor(values, list(values.shape), list(values.stride()), [1, 64, 128],
                              NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3))
    rows = 1 << (next_n - 1).bit_length()
    compiled = paged_decode_fp8_kernel.warmup(
        q, w, lens, k_desc, scales, table, out, values.shape[0], table.shape[1], table.stride(0), scales.stride(0),
        max_model_len, out.stride(0), grid=(1, 1), NEXT_N=next_n, ROWS=rows, H=heads, PER_ROW=False, TILES=16,
        STAGES=3, num_warps=4)
    resident = resident_programs(compiled, q.device)
    blocks = ctypes.c_int(0)
    libcuda = ctypes.CDLL("libcuda.so.1")
    status = libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(compiled.function), 128, ctypes.c_size_t(compiled.metadata.shared))
    assert status == 0
    assert resident == blocks.value * torch.cuda.get_device_properties(q.device).multi_processor_count


def test_fp8_gluon_decode_compiles_for_hopper():
    """The Gluon FP8 decode builds for sm_90 on any machine (ptxas ships with Triton) at the
    shapes it is chosen for; in a fresh interpreter, as this process runs Triton interpreted."""
    pytest.importorskip("triton.experimental.gluon")
    script = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from dsacache.ops.indexer_logits.decode_gluon import paged_decode_fp8_kernel as kernel

desc = "tensordesc<fp8e4nv[1, 64, 128],NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)>"
for heads, next_n, rows, rows2 in ((64, 2, 2, 0), (32, 3, 4, 0), (64, 3, 2, 1), (128, 2, 2, 0)):
    signature = dict(q_ptr="*fp8e4nv", w_ptr="*fp32", lens_ptr="*i32", k_desc=desc, scales_ptr="*fp32",
                     bt_ptr="*i32", out_ptr="*fp32", num_pages="i32", max_blocks="i32", bt_stride="i32",
                     scale_stride="i32", max_model_len="i32", out_stride="i32")
    constants = dict(NEXT_N=next_n, ROWS=rows, H=heads, PER_ROW=True, TILES=32, STAGES=4, ROWS2=rows2)
    signature.update({name: "constexpr" for name in constants})
    compiled = triton.compile(GluonASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and compiled.asm["cubin"]
    # Score products (K = 32 an instruction, one or two products), then the head sums (K = 16 each).
    assert ptx.count(f"m64n{rows * heads}k32") == 4 and ptx.count(f"m64n{rows2 * heads}k32") == 4 * (rows2 > 0)
    assert ptx.count("m64n8k16") == (rows + rows2) * heads // 16
print("built")
"""
    assert "built" in run_compiled_script(script)


#: Script head for ``run_compiled_script``: ``build(heads, next_n, rows, rows2, per_row, pairs, flag)``
#: compiles the Gluon MXFP4 decode for sm_90 (16 pages a program) and returns the compiled kernel;
#: ``sass(compiled)`` is its SASS from Triton's own cuobjdump.
MXFP4_GLUON_BUILD = """
import os, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from dsacache.ops.indexer_logits.decode_gluon import paged_decode_mxfp4_kernel as kernel

def build(heads, next_n, rows, rows2, per_row, pairs, flag=False):
    signature = dict(q_ptr="*fp8e4nv", w_ptr="*fp32", lens_ptr="*i32", pages_ptr="*u8", bt_ptr="*i32",
                     out_ptr="*fp32", num_pages="i32", max_blocks="i32", bt_stride="i32", page_stride="i32",
                     max_model_len="i32", out_stride="i32", minus_one="i32")
    constants = dict(NEXT_N=next_n, ROWS=rows, H=heads, PER_ROW=per_row, TILES=16, ROWS2=rows2, PAIRS=pairs,
                     FLAG=flag)
    signature.update({name: "constexpr" for name in constants})
    return triton.compile(GluonASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})

def sass(compiled):
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        open(path, "wb").write(compiled.asm["cubin"])
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
"""


def test_mxfp4_gluon_decode_compiles_for_hopper():
    """The Gluon MXFP4 decode builds for sm_90 on any machine at the shapes it is chosen for, with
    the table-decode PTX and both wgmmas (scores, head sums); in a fresh interpreter."""
    pytest.importorskip("triton.experimental.gluon")
    script = MXFP4_GLUON_BUILD + """
for heads, next_n, rows, rows2, per_row, pairs, flag in (
        (32, 1, 1, 0, False, True, False), (32, 1, 1, 0, True, False, True), (64, 2, 2, 0, True, False, False),
        (32, 3, 4, 0, True, False, True), (32, 3, 2, 1, True, False, True), (128, 1, 1, 0, False, False, True)):
    compiled = build(heads, next_n, rows, rows2, per_row, pairs, flag)
    ptx = compiled.asm["ptx"]
    assert "prmt.b32" in ptx and compiled.asm["cubin"]
    # Score products on the decoded keys (one or two), then the head sums, as in the FP8 kernel; two
    # pages an iteration (PAIRS) and the odd last page: three copies of the page's code.
    copies = 3 if pairs else 1
    assert ptx.count(f"m64n{rows * heads}k32") == 4 * copies
    assert ptx.count(f"m64n{rows2 * heads}k32") == 4 * (rows2 > 0) * copies
    assert ptx.count("m64n8k16") == (rows + rows2) * heads // 16 * copies
print("built")
"""
    assert "built" in run_compiled_script(script)


def test_mxfp4_gluon_decode_complements_selectors_on_the_fma_pipe():
    """The Gluon MXFP4 decode's sign lookup takes each 16-bit selector's complement as 0xFFFF +
    selector * (-1), the -1 a kernel argument, so that ptxas emits an IMAD (FMA pipe) and not an
    ALU instruction (a literal -1 gives IADD3; the sign-flip XOR it replaced was a LOP3): 16 such
    IMADs a page and thread, none of the old flips. SASS for sm_90 from Triton's own ptxas and
    cuobjdump, in a fresh interpreter."""
    pytest.importorskip("triton.experimental.gluon")
    script = MXFP4_GLUON_BUILD + """
import re

code = sass(build(32, 2, 2, 0, False, False, True))
imad = len(re.findall(r"IMAD R\\d+, R\\d+, R\\d+(?:\\.reuse)?, 0xffff ", code))
alu = len(re.findall(r"(?:IADD3|LOP3)[^;]*0x(?:ffff|8888)", code))
print(imad, alu)
"""
    imad, alu = map(int, run_compiled_script(script).split()[-2:])
    assert imad > 0 and imad % 16 == 0 and alu == 0, (imad, alu)


def test_mxfp4_gluon_decode_zeroes_dropped_groups_by_multiply_with_flag():
    """With ``FLAG`` a dropped group's tables are zeroed by a 0/1 flag, one shift by 8 and IMADs (FMA
    pipe), not by a compare and four SELs a group (ALU pipe); without it, by the SELs. SASS for sm_90
    from Triton's own ptxas and cuobjdump, in a fresh interpreter."""
    pytest.importorskip("triton.experimental.gluon")
    script = MXFP4_GLUON_BUILD + """
import re

for flag in (True, False):
    code = sass(build(32, 2, 2, 0, False, False, flag))
    flags = len(re.findall(r"SHF\\.R\\.U32\\.HI R\\d+, RZ, 0x8, ", code))
    zeroing = len(re.findall(r"SEL R\\d+, R\\d+, RZ, ", code))
    print(flags, zeroing)
"""
    lines = run_compiled_script(script).strip().split("\n")
    (flags, zeroing), (select_flags, select_zeroing) = [tuple(map(int, line.split())) for line in lines[-2:]]
    assert flags >= 2 and zeroing < 8, (flags, zeroing)
    assert select_flags == 0 and select_zeroing >= 8, (select_flags, select_zeroing)


def test_docstring_examples_run():
    import doctest

    from dsacache.ops.indexer_logits import api

    result = doctest.testmod(api, verbose=False)
    assert result.attempted >= 3 and result.failed == 0
