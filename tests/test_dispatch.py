"""The implementation rule shared by every public op (``dsacache.dispatch``)."""

import pytest
import torch

from dsacache.dispatch import interpreting, use_triton

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("ON", True), ("0", False), ("", False),
                                             ("no", False)])
def test_interpreting_reads_the_values_triton_accepts(monkeypatch, value, expected):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() is expected


def test_forced_triton_on_cpu_tensors_without_the_interpreter_names_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        use_triton("triton", x)
    assert use_triton("auto", x) is False
    assert use_triton("torch", x) is False


def test_forced_triton_on_cpu_tensors_runs_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton("triton", torch.zeros(4)) is True


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="allowed: auto, triton, torch"):
        use_triton("cuda", torch.zeros(1))
