"""MLA latent entries: the byte split of each kind, reading the kind off a page width, and the codecs."""

import pytest
import torch

from dsacache.formats.mla_entry import MlaEntryFormat, decode_entries, encode_entries, resolve_kv_cache_dtype


@pytest.mark.parametrize("dtype,rank,rope,entry", [
    ("fp8_ds_mla", 512, 64, 656),  # 512 e4m3 + 4 x 4 B scales + 64 x 2 B rope
    ("fp8_ds_mla", 512, 0, 528),
    ("auto", 512, 64, 1152),
    ("bfloat16", 512, 0, 1024),
    ("fp8", 512, 64, 576),
    ("fp8_e4m3", 256, 32, 288),
])
def test_entry_bytes_and_reading_it_back(dtype, rank, rope, entry):
    fmt = MlaEntryFormat.of(dtype, rank, rope)
    assert fmt.entry_bytes == entry
    assert MlaEntryFormat.of_entry(entry, rank, rope) == fmt
    assert MlaEntryFormat.of_entry(entry, rank, rope, dtype) == fmt


def test_refusals():
    with pytest.raises(ValueError, match="allowed: auto, bfloat16, fp8, fp8_e4m3, fp8_ds_mla"):
        resolve_kv_cache_dtype("int8")
    with pytest.raises(ValueError, match="multiple of 128"):
        MlaEntryFormat.of("fp8_ds_mla", 500, 64)
    with pytest.raises(ValueError, match="do not hold fp8_ds_mla entries"):
        MlaEntryFormat.of_entry(528, 512, 64, "fp8_ds_mla")
    with pytest.raises(ValueError, match=r"allowed widths: 1152 \(bfloat16\), 576 \(fp8\), 656 \(fp8_ds_mla\)"):
        MlaEntryFormat.of_entry(600, 512, 64)


def test_ds_mla_bytes_by_hand():
    kv_c = torch.zeros(1, 512)
    kv_c[0, 0], kv_c[0, 130] = 448.0, -2.0  # tile 0 amax 448 -> scale 1; tile 1 amax 2 -> scale 2/448
    k_pe = torch.full((1, 64), 1.5)
    entry = encode_entries(kv_c, k_pe, MlaEntryFormat.of("fp8_ds_mla", 512, 64))[0]
    assert entry[0] == 0x7E  # e4m3 448 = 0 1111 110
    assert entry[130] == 0xFE  # -448
    scales = entry[512:528].view(torch.float32)
    assert scales.tolist() == pytest.approx([1.0, 2.0 / 448, 1e-4 / 448, 1e-4 / 448])
    assert entry[528:].view(torch.bfloat16).float().eq(1.5).all()


@pytest.mark.parametrize("dtype", ["fp8_ds_mla", "bfloat16", "fp8"])
def test_round_trip_within_the_kind_precision(dtype):
    torch.manual_seed(0)
    kv_c, k_pe = torch.randn(37, 512), torch.randn(37, 64)
    fmt = MlaEntryFormat.of(dtype, 512, 64)
    k_scale = torch.tensor(0.02)
    back_c, back_pe = decode_entries(encode_entries(kv_c, k_pe, fmt, k_scale), fmt, k_scale)
    tol = 2e-2 if dtype == "bfloat16" else 7e-2  # bf16: 8 mantissa bits; e4m3: 3
    assert ((back_c - kv_c).norm() / kv_c.norm()) < tol
    assert ((back_pe - k_pe).norm() / k_pe.norm()) < tol


def test_no_rope_entry():
    fmt = MlaEntryFormat.of("fp8_ds_mla", 512, 0)
    kv_c = torch.randn(3, 512)
    entries = encode_entries(kv_c, None, fmt)
    assert entries.shape == (3, 528)
    back_c, back_pe = decode_entries(entries, fmt)
    assert back_pe.shape == (3, 0) and ((back_c - kv_c).norm() / kv_c.norm()) < 7e-2
