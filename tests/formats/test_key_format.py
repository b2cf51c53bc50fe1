"""The indexer key format's one definition: names, byte split, head-dim rule, reading it off pages."""

import pytest

from dsacache import CacheConfig, plan
from dsacache.formats.key_format import IndexerKeyFormat, indexer_entry_bytes, resolve_indexer_kv_dtype


@pytest.mark.parametrize("name,head_dim,split", [
    ("fp8", 128, (128, 4, 132)),
    ("auto", 128, (128, 4, 132)),
    ("mxfp4", 128, (64, 4, 68)),  # 128 / 2 packed bytes + 128 / 32 scale bytes
    ("mxfp4", 32, (16, 1, 17)),
    ("fp8", 48, (48, 4, 52)),
])
def test_split(name, head_dim, split):
    fmt = IndexerKeyFormat.of(name, head_dim)
    assert (fmt.value_bytes, fmt.scale_bytes, fmt.entry_bytes) == split
    assert indexer_entry_bytes(head_dim, name) == split[2]


@pytest.mark.parametrize("call,match", [
    (lambda: IndexerKeyFormat.of("int8", 128), "indexer_kv_dtype='int8' is not supported; allowed: auto, fp8, mxfp4"),
    (lambda: IndexerKeyFormat.of(None, 128), "must be a string"),
    (lambda: IndexerKeyFormat.of("mxfp4", 48), "index_head_dim=48 must be a multiple of 32"),
    (lambda: IndexerKeyFormat.of("fp8", 0), "index_head_dim=0 must be a positive integer"),
    (lambda: IndexerKeyFormat("auto", 128), "allowed: fp8, mxfp4"),
    (lambda: IndexerKeyFormat.of(IndexerKeyFormat("fp8", 64), 128), "head_dim=64, keys have 128"),
    (lambda: resolve_indexer_kv_dtype("FP8"), "allowed: auto, fp8, mxfp4"),
])
def test_refusals(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_of_entry_reads_the_width_and_checks_a_given_name():
    assert IndexerKeyFormat.of_entry(132, 128).name == "fp8"
    assert IndexerKeyFormat.of_entry(68, 128).name == "mxfp4"
    assert IndexerKeyFormat.of_entry(68, 128, "mxfp4").name == "mxfp4"
    with pytest.raises(ValueError, match="do not hold fp8 keys"):
        IndexerKeyFormat.of_entry(68, 128, "fp8")
    with pytest.raises(ValueError, match="match no key format"):
        IndexerKeyFormat.of_entry(100, 128)


def test_the_layout_names_its_format():
    assert plan(CacheConfig.from_model("kimi-k3.1")).indexer_key_format == IndexerKeyFormat("fp8", 128)
    mx = plan(CacheConfig.from_model("kimi-k3.1", indexer_kv_dtype="mxfp4"))
    assert mx.indexer_key_format == IndexerKeyFormat("mxfp4", 128)
    assert plan(CacheConfig.from_model("kimi-linear-48b")).indexer_key_format is None
