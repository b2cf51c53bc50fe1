"""The mla bench's input builders and correctness gate, run on CPU (the bench itself needs CUDA)."""

import pytest
import torch

from dsacache.bench import mla
from dsacache.bench.harness import CorrectnessError
from dsacache.formats.mla_entry import decode_entries
from tests.helpers import triton_available


def test_pool_and_inputs():
    pages = mla.build_pool(3000, "cpu")
    assert pages.shape == (47, 64, 656) and pages.stride() == (2 * 64 * 656, 656, 1)
    kv_c, k_pe = decode_entries(pages[46, 63], mla.FMT)
    assert bool(kv_c.abs().sum() > 0) and bool(k_pe.abs().sum() > 0)   # the last page is filled too
    inputs = mla.build_inputs(3, 2, 12, 100, pages)
    assert inputs.q.shape == (3, 2, 12, 576) and inputs.q.dtype == torch.bfloat16
    assert len(inputs.index_sets) == mla.INDEX_SETS
    for idx in inputs.index_sets:
        assert idx.shape == (3, 2, 100) and idx.dtype == torch.int32
        assert int(idx.min()) >= 0 and int(idx.max()) < 47 * 64
    assert not torch.equal(inputs.index_sets[0], inputs.index_sets[1])
    again = mla.build_inputs(3, 2, 12, 100, pages)
    assert torch.equal(again.q, inputs.q) and torch.equal(again.indices, inputs.indices)  # same inputs for peers


def test_counts():
    assert mla.flops(128, 2, 128, 2048) == 2 * 256 * 128 * 2048 * 1088
    assert mla.moved_bytes(64, 1, 12, 2048) == 64 * (2048 * 660 + 12 * (1152 + 1024 + 4))


@pytest.mark.interpret
@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_gate_passes_the_kernel_and_catches_a_wrong_output(monkeypatch):
    pages = mla.build_pool(2048, "cpu")
    inputs = mla.build_inputs(2, 1, 12, 64, pages)
    assert mla.check(inputs, pages, {"splits": 2}) < mla.OUT_RMS
    real = mla._triton_call

    def off_by_a_bit(*args, **kw):
        out, lse = real(*args, **kw)
        return out * 1.05, lse

    monkeypatch.setattr(mla, "_triton_call", off_by_a_bit)
    with pytest.raises(CorrectnessError, match="out rel. RMS error"):
        mla.check(inputs, pages, {"splits": 1})
