"""The public, torch-free API: ``dsacache.__all__`` pinned, every name documented."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import dsacache
import dsacache.planner

PUBLIC = {
    "AttentionSlot", "CacheConfig", "CacheLayout", "ConfigError", "DraftSlot", "ModelSpec",
    "PD_REFERENCE_TP", "SpeculativeConfig", "StateShape", "StateSlot", "load_model", "plan",
}
SRC = Path(__file__).resolve().parents[2] / "src"


def test_all_is_pinned():
    assert set(dsacache.__all__) == PUBLIC
    assert len(dsacache.__all__) == len(PUBLIC)  # no duplicates
    assert set(dsacache.planner.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(dsacache, name) is getattr(dsacache.planner, name)


def _own_doc(obj) -> str:
    doc = obj.__doc__ or ""
    # dataclasses invent "Name(field, ...)" when a class has no docstring
    if inspect.isclass(obj) and doc.startswith(obj.__name__ + "("):
        return ""
    return doc.strip()


def test_every_public_class_and_function_has_a_docstring():
    for name in PUBLIC - {"PD_REFERENCE_TP"}:
        obj = getattr(dsacache, name)
        assert inspect.isclass(obj) or inspect.isfunction(obj), name
        assert _own_doc(obj), f"{name} has no docstring"


def test_public_constant_is_documented():
    # a constant cannot carry __doc__; it is documented by a '#:' comment above its assignment
    source = (SRC / "dsacache" / "config" / "serving.py").read_text()
    assert re.search(r"#:[^\n]*\n(#:[^\n]*\n)*PD_REFERENCE_TP = 8\n", source)
    assert dsacache.PD_REFERENCE_TP == 8


def test_public_methods_have_docstrings():
    for cls, names in [(dsacache.CacheConfig, ["from_model", "from_config_dict", "resolved_indexer_kv_dtype",
                                               "draft_kv_cache_dtype"]),
                       (dsacache.ModelSpec, ["from_dict", "is_packed_hybrid"]),
                       (dsacache.SpeculativeConfig, ["from_json", "has_mla_draft"]),
                       (dsacache.CacheLayout, ["with_block_size", "rows_per_request", "page_stride_bytes",
                                               "token_capacity"])]:
        for name in names:
            member = inspect.getattr_static(cls, name)
            target = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            assert (target.__doc__ or "").strip(), f"{cls.__name__}.{name} has no docstring"


def test_plan_signature():
    params = inspect.signature(dsacache.plan).parameters
    assert list(params) == ["config", "num_rows"]
    assert params["num_rows"].default is None


def test_import_dsacache_needs_no_torch():
    code = ("import sys, dsacache\n"
            "dsacache.plan(dsacache.CacheConfig.from_model('kimi-k3.1'))\n"
            "print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={"PYTHONPATH": str(SRC), "PATH": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
