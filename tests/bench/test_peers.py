"""The peers beside the bench (``--peers DIR``): loading, call wrappers, agreement, timing arithmetic, rows.

The real peers need an H200; here their loading fails or is faked, and each wrapper is driven
with a stand-in op that records what it was given.
"""

import io
import json
import lzma
import os
import sys
import tarfile

import pytest
import torch

from dsacache.bench import harness, peers
from dsacache.bench.__main__ import SUITES, build_parser
from dsacache.bench.harness import BenchRow
from dsacache.formats.indexer_key import split_indexer_pages
from dsacache.formats.key_format import IndexerKeyFormat
from dsacache.ops.indexer_logits import per_row_context_lens

ALL_PEERS = ("logits", "store", "topk", "sparse_mla")


def _skipped_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if " skipped: " in line]


def test_an_empty_directory_reports_each_peer_missing_and_skips_it(tmp_path, capsys):
    loaded = peers.load_peers(tmp_path)
    lines = _skipped_lines(capsys.readouterr().err)
    assert len(lines) == 4
    for key, name, pack_file in [("logits", "DeepGEMM", "dg.tar.xz"), ("store", "indexer_k_quant_and_cache", "vc.so.xz"),
                                 ("topk", "persistent_topk", "vc.so.xz"), ("sparse_mla", "FlashMLA", "fmla.so")]:
        assert loaded.get(key) is None
        peer = loaded.peers[key]
        assert not peer.available() and peer.reason == f"{tmp_path / pack_file} not found"
        assert sum(name in line and pack_file in line for line in lines) == 1
    assert all(reason != "loaded" for reason in loaded.summary().values())


def test_a_missing_directory_is_reported_the_same_way(tmp_path, capsys):
    loaded = peers.load_peers(tmp_path / "nowhere")
    assert all(loaded.get(key) is None for key in ALL_PEERS)
    assert len(_skipped_lines(capsys.readouterr().err)) == 4


def test_broken_files_are_reported_with_what_failed(tmp_path, capsys):
    (tmp_path / "dg.tar.xz").write_bytes(b"not a tar")
    (tmp_path / "vc.so.xz").write_bytes(lzma.compress(b"not a shared library"))
    (tmp_path / "fmla.so").write_bytes(b"not a shared library either")
    loaded = peers.load_peers(tmp_path)
    assert "ReadError" in loaded.peers["logits"].reason
    for key in ("store", "topk"):
        assert "OSError" in loaded.peers[key].reason and "vc.so.xz" in loaded.peers[key].reason
    assert "OSError" in loaded.peers["sparse_mla"].reason
    assert len(_skipped_lines(capsys.readouterr().err)) == 4
    assert all(loaded.get(key) is None for key in ALL_PEERS)


def test_a_peer_needs_its_op_or_a_reason():
    with pytest.raises(ValueError, match="reason"):
        peers.VllmTopk(None, "")


FAKE_DEEP_GEMM = '''
import torch
calls = []
def get_num_sms():
    return 132
def get_paged_mqa_logits_metadata(context_lens, block, num_sms):
    calls.append(("meta", context_lens.clone(), block, num_sms))
    return torch.tensor([7])
def fp8_fp4_paged_mqa_logits(q, kv, weights, context_lens, block_table, meta, max_model_len):
    calls.append(("logits", q, kv, weights, context_lens, block_table, meta, max_model_len))
    return torch.zeros(weights.shape[0], max_model_len)
'''


@pytest.fixture
def fake_deep_gemm_pack(tmp_path, monkeypatch):
    """A pack directory whose dg.tar.xz holds a stand-in ``deep_gemm`` package."""
    data = FAKE_DEEP_GEMM.encode()
    with tarfile.open(tmp_path / "dg.tar.xz", "w:xz") as tar:
        info = tarfile.TarInfo("deep_gemm/__init__.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    yield tmp_path
    sys.modules.pop("deep_gemm", None)


def test_deep_gemm_is_unpacked_imported_and_called_on_the_suites_inputs(fake_deep_gemm_pack, capsys):
    loaded = peers.load_peers(fake_deep_gemm_pack)
    peer = loaded.get("logits")
    assert peer is not None and loaded.summary()[peer.name] == "loaded"
    assert os.environ["CUDA_HOME"] == "/usr/local/cuda"
    assert len(_skipped_lines(capsys.readouterr().err)) == 3  # the other files are missing
    batch, next_n, heads, ctx = 3, 2, 32, 200
    pool = torch.zeros(10, 2, 64 * 132, dtype=torch.uint8)
    pages = pool[:, 1].view(10, 64, 132)  # a layer's view: page stride two pages
    q = torch.randn(batch, next_n, heads, 128).to(torch.float8_e4m3fn)
    weights = torch.rand(batch * next_n, heads)
    seq_lens = torch.tensor([200, 65, 1], dtype=torch.int32)
    block_table = torch.arange(batch * 4, dtype=torch.int32).view(batch, 4) % 10
    call = peer.make_call(q, weights, seq_lens, pages, block_table, ctx)
    module = sys.modules["deep_gemm"]
    (_, meta_lens, block, sms), = module.calls
    want_lens = per_row_context_lens(seq_lens, next_n)
    assert torch.equal(meta_lens, want_lens) and meta_lens.dtype == torch.int32 and (block, sms) == (64, 132)
    out = call()
    assert out.shape == (batch * next_n, ctx)
    _, (q_arg, q_scale), kv, w, lens, table, meta, max_len = module.calls[1]
    assert q_arg is q and q_scale is None and w is weights and table is block_table and max_len == ctx
    assert torch.equal(lens, want_lens) and torch.equal(meta, torch.tensor([7]))
    assert kv.shape == (10, 64, 1, 132) and kv.data_ptr() == pages.data_ptr()
    assert kv.stride(0) == pages.stride(0) == 2 * 64 * 132
    mxfp4_pages = torch.zeros(10, 64, 68, dtype=torch.uint8)
    with pytest.raises(peers.PeerUnsupported, match="entry of 68 bytes"):
        peer.make_call(q, weights, seq_lens, mxfp4_pages, block_table, ctx)


def test_deep_gemm_limits_on_sm90():
    assert peers.deepgemm_unsupported(32, 1, (9, 0)) is None
    assert peers.deepgemm_unsupported(64, 2, (9, 0)) is None
    assert "H=12" in peers.deepgemm_unsupported(12, 1, (9, 0))
    assert "next_n=3" in peers.deepgemm_unsupported(64, 3, (9, 0))
    assert peers.deepgemm_unsupported(12, 3, (10, 0)) is None


class Recorder:
    """A stand-in op: records its arguments, then runs ``effect`` on them."""

    def __init__(self, effect=None):
        self.calls, self.effect = [], effect

    def __call__(self, *args):
        self.calls.append(args)
        return self.effect(*args) if self.effect else None


def test_vllm_store_writes_a_contiguous_cache_of_its_own():
    op = Recorder()
    peer = peers.VllmKeyStore(op)
    k = torch.randn(5, 128, dtype=torch.bfloat16)
    slots = torch.tensor([3, 64, 127, 0, 200], dtype=torch.int32)
    cache = peer.make_call(k, slots, num_pages=4)()
    (k_arg, cache_arg, slots_arg, block, scale_fmt), = op.calls
    assert k_arg is k and cache_arg is cache and (block, scale_fmt) == (128, "ue8m0")
    assert cache.shape == (4, 64, 132) and cache.dtype == torch.uint8 and cache.is_contiguous()
    assert slots_arg.dtype == torch.int64 and torch.equal(slots_arg, slots.long())
    with pytest.raises(peers.PeerUnsupported, match="head_dim=64"):
        peer.make_call(torch.randn(5, 64, dtype=torch.bfloat16), slots, num_pages=4)


def _fake_topk(logits, lens, out, workspace, k, length):
    assert workspace.numel() == peers.TOPK_WORKSPACE_BYTES and length == logits.shape[1]
    out.copy_(logits.topk(k, dim=1).indices.flip(1))  # a valid answer in another order


def test_vllm_topk_call_and_its_agreement_with_the_reference():
    peer = peers.VllmTopk(Recorder(_fake_topk))
    logits = torch.randn(3, 4096)
    lens = torch.full((3,), 4096, dtype=torch.int32)
    out = peer.make_call(logits, lens, 2048)()
    ref = logits.topk(2048, dim=1).indices.sort(dim=1).values.int()
    assert out.shape == (3, 2048) and out.dtype == torch.int32
    assert peers.topk_agreement(out, ref, logits) == (True, "")
    with pytest.raises(peers.PeerUnsupported, match="k=100"):
        peer.make_call(logits, lens, 100)


def test_topk_agreement_catches_a_wrong_position():
    logits = torch.randn(4, 256)
    ref = logits.topk(16, dim=1).indices.sort(dim=1).values
    bad = ref.clone()
    bad[2, 0] = logits[2].argmin()
    agrees, note = peers.topk_agreement(bad, ref, logits)
    assert not agrees and note == "1 of 4 rows pick other values"
    out_of_range = ref.clone()
    out_of_range[1, 3] = 256
    assert not peers.topk_agreement(out_of_range, ref, logits)[0]


def test_topk_agreement_accepts_another_choice_among_ties():
    logits = torch.zeros(2, 8)
    logits[:, 2] = logits[:, 5] = 1.0  # k=1: position 2 or 5
    ref = torch.tensor([[2], [2]])
    agrees, note = peers.topk_agreement(torch.tensor([[5], [2]]), ref, logits)
    assert agrees and note == "1 of 2 rows pick other positions among tied logits"


def test_topk_agreement_on_short_rows_and_nan():
    logits = torch.tensor([[1.0, float("nan"), 3.0, 0.5], [4.0, 2.0, 1.0, 0.0]])
    ref = torch.tensor([[0, 2, -1], [0, 1, 2]])  # row 0 holds 2 finite candidates here, padded with -1
    assert peers.topk_agreement(torch.tensor([[-1, 2, 0], [2, 0, 1]]), ref, logits) == (True, "")
    assert not peers.topk_agreement(torch.tensor([[0, 2, 3], [2, 0, 1]]), ref, logits)[0]
    nan_ties = torch.tensor([[float("nan"), float("nan"), 1.0, 0.0]])
    assert peers.topk_agreement(torch.tensor([[1, 2]]), torch.tensor([[0, 2]]), nan_ties)[0]
    assert not peers.topk_agreement(torch.tensor([[1, 3]]), torch.tensor([[0, 2]]), nan_ties)[0]


def test_flashmla_heads_pad_to_64_or_128():
    assert [peers.flashmla_heads(h) for h in (1, 12, 64, 65, 128)] == [64, 64, 64, 128, 128]
    for heads in (0, 129):
        with pytest.raises(peers.PeerUnsupported, match=f"H={heads}"):
            peers.flashmla_heads(heads)


def test_flashmla_call_pads_the_queries_and_returns_the_real_heads():
    def decode(q, kv, idx, *rest):
        batch, s_q, heads, _ = q.shape
        return q[..., :512].clone(), torch.ones(batch, heads, s_q), None, None

    op = Recorder(decode)
    peer = peers.FlashMlaSparseDecode(op)
    pool = torch.zeros(6, 3, 64 * 656, dtype=torch.uint8)
    pages = pool[:, 0].view(6, 64, 656)
    q = torch.randn(2, 1, 12, 576, dtype=torch.bfloat16)
    indices = torch.randint(-1, 6 * 64, (2, 1, 2048))
    out, lse = peer.make_call(q, pages, indices, 0.1)()
    q_arg, kv, idx, *rest = op.calls[0]
    assert q_arg.shape == (2, 1, 64, 576) and torch.equal(q_arg[:, :, :12], q) and not q_arg[:, :, 12:].any()
    assert kv.shape == (6, 64, 1, 656) and kv.stride(0) == pages.stride(0) and kv.data_ptr() == pages.data_ptr()
    assert idx.dtype == torch.int32 and torch.equal(idx, indices.int())
    assert rest == [None] * 7 + [512, 0.1, None, False]
    assert out.shape == (2, 1, 12, 512) and torch.equal(out, q[..., :512]) and lse.shape == (2, 12, 1)
    with pytest.raises(peers.PeerUnsupported, match="656 bytes 700 apart"):
        peer.make_call(q, torch.zeros(6, 64, 700, dtype=torch.uint8)[:, :, :656], indices, 0.1)
    with pytest.raises(peers.PeerUnsupported, match="1152 bytes"):
        peer.make_call(q, torch.zeros(6, 64, 1152, dtype=torch.uint8), indices, 0.1)


def _row(**kw):
    return BenchRow("topk_indices", "B=4 L=256 k=16", 1.0, 4_000_000_000, 8000.0, **kw)


class FakePeer(peers.Peer):
    name = "fake peer"
    pack_file = "fake.so"


def _agree(out):
    return True, ""


def test_attach_peer_checks_then_times_with_the_given_timer():
    timed = []
    row = peers.attach_peer(_row(), FakePeer(object()), lambda: (lambda: "out"), _agree,
                            timer=lambda fn: timed.append(fn()) or 0.25)
    assert timed == ["out"] and row.peer == "fake peer" and row.peer_ms == 0.25 and row.peer_note is None
    assert row.peer_ratio == 0.25
    assert peers.attach_peer(_row(), None, lambda: pytest.fail("built"), _agree, timer=pytest.fail).peer is None


def test_a_disagreeing_peer_is_reported_and_not_timed(capsys):
    row = peers.attach_peer(_row(), FakePeer(object()), lambda: (lambda: "out"), lambda out: (False, "3 rows"),
                            timer=lambda fn: pytest.fail("timed"))
    assert row.peer_ms is None and row.peer_note == "disagrees with the reference: 3 rows"
    assert "fake peer" in capsys.readouterr().err and "not timed (disagrees" in row.line()


def test_a_failing_or_unsupported_peer_is_reported_not_fatal(capsys):
    def boom():
        raise RuntimeError("CUDA error: no kernel image\nmore")

    row = peers.attach_peer(_row(), FakePeer(object()), lambda: boom, _agree, timer=pytest.fail)
    assert row.peer_ms is None and row.peer_note == "failed: RuntimeError: CUDA error: no kernel image"
    assert capsys.readouterr().err.count("\n") == 1

    def unsupported():
        raise peers.PeerUnsupported("H=12: no")

    row = peers.attach_peer(_row(), FakePeer(object()), unsupported, _agree, timer=pytest.fail)
    assert row.peer_note == "not run: H=12: no" and capsys.readouterr().err == ""

    def no_capture(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    row = peers.attach_peer(_row(), FakePeer(object()), lambda: (lambda: 0), _agree, timer=no_capture)
    assert row.peer_ms is None and row.peer_note.startswith("failed while timing: RuntimeError")


def test_a_note_from_an_agreeing_peer_stays_on_the_row():
    row = peers.attach_peer(_row(), FakePeer(object()), lambda: (lambda: 0), lambda out: (True, "ties"),
                            timer=lambda fn: 2.0)
    assert row.peer_ms == 2.0 and row.peer_note == "ties" and row.line().endswith("peer/ours 2.00x (ties)")


def test_rows_print_and_record_both_sides(tmp_path, capsys):
    plain = _row(extra={"eager_us": "3.0"})
    side = _row(peer="vLLM persistent_topk", peer_ms=2.0)
    path = tmp_path / "out.json"
    harness.print_report({"gpu": "test"}, 8000.0, [plain, side], str(path))
    printed = capsys.readouterr().out.splitlines()
    assert "|" not in printed[2] and printed[2].endswith("eager_us=3.0")
    assert "1000.0 us     4000 GB/s  50.0% of copy" in printed[3]
    assert printed[3].endswith("| vLLM persistent_topk: 2000.0 us 2000 GB/s 25.0% of copy, peer/ours 2.00x")
    rows = json.loads(path.read_text())["rows"]
    assert "peer" not in rows[0] and "peer_ms" not in rows[0]
    assert rows[1]["ms"] == 1.0 and rows[1]["gbps"] == 4000.0 and rows[1]["ratio"] == 0.5
    assert rows[1]["peer"] == "vLLM persistent_topk" and rows[1]["peer_ms"] == 2.0
    assert rows[1]["peer_gbps"] == 2000.0 and rows[1]["peer_of_ceiling"] == 0.25 and rows[1]["peer_ratio"] == 2.0
    untimed = _row(peer="DeepGEMM", peer_note="not run: H=12").as_dict()
    assert untimed["peer_ms"] is None and untimed["peer_note"] == "not run: H=12" and "peer_ratio" not in untimed


def test_window_median_is_per_call_and_skips_the_first_replay():
    replays = iter([1000.0, 40.0, 60.0, 20.0, 100.0, 50.0])
    assert harness.window_median_ms(lambda: next(replays), window=20, windows=5) == 2.5
    assert next(replays, "done") == "done"
    for window, windows in [(0, 5), (20, 0)]:
        with pytest.raises(ValueError, match="must be >= 1"):
            harness.window_median_ms(lambda: 1.0, window, windows)


def test_median_ms_discards_warmup():
    times = iter([9.0, 9.0, 1.0, 3.0, 2.0])
    assert harness.median_ms(lambda: next(times), warmup=2, rep=3) == 2.0


def test_peer_for_reads_the_loaded_set():
    import argparse

    assert peers.peer_for(argparse.Namespace(), "topk") is None
    assert peers.peer_for(argparse.Namespace(peers=None), "topk") is None
    topk = peers.VllmTopk(object())
    loaded = peers.PeerSet({"topk": topk, "store": peers.VllmKeyStore(None, "vc.so.xz not found")})
    args = argparse.Namespace(peers=loaded)
    assert peers.peer_for(args, "topk") is topk and peers.peer_for(args, "store") is None
    assert peers.peer_for(args, "logits") is None


def test_a_peer_keeps_its_unpacked_pack_after_its_set_is_gone():
    """DeepGEMM compiles from the unpacked pack at its first call: a peer taken out of a set that
    is then dropped (``load_peers(d).get("logits")``) must still find it."""
    import gc
    import tempfile

    scratch = tempfile.TemporaryDirectory(prefix="dsacache-peers-test-")
    path = scratch.name
    peer = peers.PeerSet({"logits": peers.DeepGemmLogits(object())}, scratch).get("logits")
    del scratch
    gc.collect()
    assert peer is not None and os.path.isdir(path)
    del peer
    gc.collect()
    assert not os.path.exists(path)


@pytest.mark.parametrize("suite", list(SUITES))
def test_every_suite_takes_peers(suite):
    parser = build_parser()
    assert parser.parse_args([suite]).peers is None
    assert parser.parse_args([suite, "--peers", "/x/.peers"]).peers == "/x/.peers"


def _one_call(fn, *args, **kwargs):
    fn()
    return 1.0


def _vllm_like_store(scale, stray):
    """A stand-in for vLLM's op: dsacache's reference FP8 store into the contiguous cache
    (the same bytes), of the keys times ``scale``; with ``stray``, one more byte written."""
    from dsacache.ops.indexer_k_cache import store_indexer_keys

    def op(k, cache, slots, block, scale_fmt):
        store_indexer_keys(k * scale, cache, slots, impl="torch")
        if stray:  # the first value byte of a slot no key goes to
            free = min(set(range(cache.shape[0] * 64)) - set(slots.tolist()))
            values, _ = split_indexer_pages(cache, IndexerKeyFormat("fp8", 128))
            values[free // 64, free % 64, 0] = 1

    return op


@pytest.mark.parametrize("scale,stray,agrees", [(1, False, True), (4, False, False), (1, True, False)])
def test_kcache_rows_carry_the_store_peer(scale, stray, agrees, monkeypatch, capsys):
    import argparse

    from dsacache.bench import k_cache

    monkeypatch.setattr(k_cache, "time_graph", lambda fn: _one_call(fn) * 2)
    monkeypatch.setattr(k_cache, "time_cuda", _one_call)
    store = peers.VllmKeyStore(_vllm_like_store(scale, stray))
    args = argparse.Namespace(tokens=[1, 100], sweep=False, ceiling_gbps=4000.0,
                              peers=peers.PeerSet({"store": store}))
    rows = k_cache.store_rows(args, "fp8", (0.001, 0.001), device="cpu")
    with_peer = [row for row in rows if row.peer is not None]
    assert [(row.op, row.shape.split()[0]) for row in with_peer] == [("store fp8 plain", "T=1"),
                                                                   ("store fp8 plain", "T=100")]
    for row in with_peer:
        assert row.peer == "vLLM indexer_k_quant_and_cache"
        if agrees:
            assert row.peer_ms == 2.0 and row.peer_note is None and row.as_dict()["peer_ratio"] == 1.0
        else:
            assert row.peer_ms is None and row.peer_note.startswith("disagrees with the reference")
            assert ("outside the slots" in row.peer_note) == stray
    assert capsys.readouterr().err.count("disagrees") == (0 if agrees else 2)


class FakeDeepGemm:
    """Stands in for the deep_gemm module: the reference logits (times ``scale``), NaN past each
    row's length (where DeepGEMM's values are not defined)."""

    def __init__(self, scale=1.0):
        self.scale = scale

    def get_num_sms(self):
        return 132

    def get_paged_mqa_logits_metadata(self, context_lens, block, num_sms):
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    def fp8_fp4_paged_mqa_logits(self, q, kv, weights, context_lens, block_table, meta, max_model_len):
        from dsacache.ops.indexer_logits import paged_decode_logits

        out = paged_decode_logits(q[0], weights * self.scale, context_lens, kv.squeeze(2), block_table,
                                  max_model_len=max_model_len, impl="torch")
        return torch.where(out.isneginf(), float("nan"), out)


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("scale,agrees", [(1.0, True), (-1.0, False)])
def test_logits_rows_carry_deepgemm(next_n, scale, agrees, monkeypatch, capsys):
    import argparse

    from dsacache.bench import logits

    monkeypatch.setattr(logits, "time_graph", lambda fn: _one_call(fn) * 2)
    monkeypatch.setattr(logits, "time_cuda", _one_call)
    peer_set = peers.PeerSet({"logits": peers.DeepGemmLogits(FakeDeepGemm(scale))})
    args = argparse.Namespace(next_n=next_n, ceiling_gbps=4000.0, peers=peer_set)
    fp8_ms, peer_ms, rows = {}, {}, []
    for fmt in ("fp8", "mxfp4"):
        pages = logits.make_pages(8, fmt, torch.device("cpu"))
        q, w, lens, (table,) = logits.make_inputs(2, 256, 32, next_n, pages)
        inputs = (q, w, lens, pages, table)
        rows.append(logits.time_row(args, inputs, fmt, 256, 1000, fp8_ms, peer_ms))
    fp8, mxfp4 = rows
    assert fp8.peer == "DeepGEMM fp8_fp4_paged_mqa_logits" and mxfp4.peer is None
    assert mxfp4.extra["speedup_vs_fp8"] == "1.00x"
    if agrees:
        assert fp8.peer_ms == 2.0 and fp8.peer_note.startswith("calc-diff")
        assert mxfp4.extra["deepgemm_fp8_us"] == "2000.0" and mxfp4.extra["speedup_vs_deepgemm_fp8"] == "1.00x"
    else:
        assert fp8.peer_ms is None and fp8.peer_note.startswith("disagrees with the reference: calc-diff")
        assert "deepgemm_fp8_us" not in mxfp4.extra and "disagrees" in capsys.readouterr().err


def test_wide_logits_shapes_are_issue_20s():
    from dsacache.bench import logits

    args = build_parser().parse_args(["logits", "--shapes", "wide"])
    assert logits.shape_pairs(args) == [(32, 8192), (32, 65536), (128, 8192), (128, 65536)]
    args = build_parser().parse_args(["logits", "--batch", "32", "64", "--ctx", "4096"])
    assert logits.shape_pairs(args) == [(32, 4096), (64, 4096)]
    assert logits.shape_pairs(build_parser().parse_args(["logits"])) == [(64, 32768), (64, 131072)]


def _flashmla_like(scale, seen):
    """A stand-in for FlashMLA's op: the reference on the (padded) queries, out times ``scale``,
    lse as ``[B, H, s_q]``; records the index tensors it was given."""
    from dsacache.ops.sparse_mla import sparse_mla_decode

    def op(q, kv, idx, *rest):
        seen.append(idx)
        out, lse = sparse_mla_decode(q, kv.squeeze(2), idx, rest[8], impl="torch")
        return out * scale, lse.transpose(1, 2), None, None

    return op


@pytest.mark.parametrize("scale,agrees", [(1.0, True), (1.05, False)])
def test_mla_rows_carry_flashmla_on_the_rotating_index_sets(scale, agrees, monkeypatch):
    import argparse

    from dsacache.bench import mla

    calls = []

    def timer(fn):
        for _ in range(2 * mla.INDEX_SETS):
            fn()
        calls.append(fn)
        return 3.0

    monkeypatch.setattr(mla, "time_graph", timer)
    pages = mla.build_pool(2048, "cpu")
    inputs = mla.build_inputs(2, 1, 12, 64, pages)
    ref = mla.reference(inputs, pages)
    seen = []
    peer_set = peers.PeerSet({"sparse_mla": peers.FlashMlaSparseDecode(_flashmla_like(scale, seen))})
    row = BenchRow("sparse_mla_decode", "B=2 s_q=1 H=12", 1.0, 1000, 4000.0)
    mla._attach_flashmla(argparse.Namespace(peers=peer_set), row, inputs, pages, ref)
    assert row.peer == "FlashMLA sparse_decode_fwd" and "out rel. RMS error" in row.peer_note
    if agrees:
        assert row.peer_ms == 3.0 and "lse rel. error" in row.peer_note
        assert len(seen) == 1 + 2 * mla.INDEX_SETS and torch.equal(seen[0], inputs.index_sets[0])
        for i, idx in enumerate(seen):  # the window visits every index set in turn
            assert torch.equal(idx, inputs.index_sets[i % mla.INDEX_SETS])
    else:
        assert row.peer_ms is None and row.peer_note.startswith("disagrees") and not calls
