"""``dsacache plan``, run as the real command in a subprocess.

Expected figures are hand-computed from ``docs/planning.md`` (see tests/planner/test_layout.py
for the arithmetic). Every bad input must exit 2 with a ``dsacache: error`` / argparse
``error:`` line naming the setting, and never print a traceback.
"""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsacache.config.model import builtin_config_dict

SRC = Path(__file__).resolve().parents[2] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
GIB48 = "48GiB"  # 51,539,607,552 B

STABLE_TYPES = {
    "block_size": (int, type(None)),
    "states_per_row": (int, type(None)),
    "row_bytes_per_token": int,
    "index_bytes_per_token": int,
    "mla_bytes_per_token": int,
    "draft_bytes_per_token": int,
    "state_bytes": int,
    "indexer_kv_dtype": str,
    "num_rows": int,
    "token_capacity": int,
}


def run_plan(*args, python_flags=()):
    return subprocess.run([sys.executable, *python_flags, "-m", "dsacache", "plan", *args],
                          capture_output=True, text=True, env=ENV, timeout=60)


def plan_json(*args):
    result = run_plan("--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def check_contract(obj):
    assert isinstance(obj, dict)
    for key, types in STABLE_TYPES.items():
        assert key in obj, key
        assert isinstance(obj[key], types), (key, obj[key])
        if types is int:
            assert not isinstance(obj[key], bool)
    assert obj["indexer_kv_dtype"] in ("fp8", "mxfp4")


def write_config(tmp_path, raw, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(raw) if not isinstance(raw, str) else raw)
    return path


# --- the JSON contract ----------------------------------------------------------------------


def test_default_json_is_k31_tp8():
    out = plan_json("--kv-cache-memory-bytes", GIB48)
    check_contract(out)
    assert out["block_size"] == 1024
    assert out["states_per_row"] == 23
    assert out["row_bytes_per_token"] == 18912  # 24 x (656 + 132)
    assert out["index_bytes_per_token"] == 132
    assert out["mla_bytes_per_token"] == 656  # fp8_ds_mla, 512 + 64: 512 + 16 + 128
    assert out["draft_bytes_per_token"] == 0
    assert out["state_bytes"] == 814080
    assert out["indexer_kv_dtype"] == "fp8"
    assert out["num_rows"] == 2660  # 51,539,607,552 // (1024 x 18912), less the guard row
    assert out["token_capacity"] == 2660 * 1024
    assert out["page_stride_bytes"] == 1210368  # 64 x 18912


def test_tp_list_prints_a_list():
    out = plan_json("--tensor-parallel-size", "1,2,4,8,16")
    assert isinstance(out, list) and len(out) == 5
    for obj in out:
        check_contract(obj)
    assert [o["block_size"] for o in out] == [8192, 4096, 2048, 1024, 512]
    assert [o["state_bytes"] for o in out] == [6512640, 3256320, 1628160, 814080, 407040]
    assert [o["tensor_parallel_size"] for o in out] == [1, 2, 4, 8, 16]


def test_single_item_tp_list_prints_an_object():
    out = plan_json("-tp", "4")
    assert isinstance(out, dict)
    assert out["block_size"] == 2048


def test_mxfp4_and_dtype_options():
    out = plan_json("--attention-config", '{"indexer_kv_dtype": "mxfp4"}', "--kv-cache-dtype", "bfloat16")
    check_contract(out)
    assert out["indexer_kv_dtype"] == "mxfp4"
    assert out["index_bytes_per_token"] == 68
    assert out["mla_bytes_per_token"] == 1152  # 2 x (512 + 64)
    assert out["row_bytes_per_token"] == 29280  # 24 x (1152 + 68)
    assert out["block_size"] == 640  # ceil(18,723,840 / (64 x 29280)) = ceil(9.99) = 10 units


def test_dspark_speculative_config():
    spec = '{"method": "dspark", "num_speculative_tokens": 3, "model": "kimi-k3.1-dspark"}'
    out = plan_json("--speculative-config", spec)
    assert out["draft_bytes_per_token"] == 3280  # 5 x 656
    assert out["row_bytes_per_token"] == 22192  # 18912 + 3280
    assert out["state_bytes"] == 841728
    assert out["block_size"] == 896  # ceil(23 x 841,728 / (64 x 22192)) = ceil(13.63) = 14 units
    assert out["pow2"]["block_size"] == 1024


def test_kimi_linear_has_null_block_size():
    out = plan_json("--model", "kimi-linear-48b", "--kv-cache-memory-bytes", GIB48)
    check_contract(out)
    assert out["block_size"] is None
    assert out["index_bytes_per_token"] == 0
    assert out["mla_bytes_per_token"] == 656
    assert out["row_bytes_per_token"] == 4592
    assert out["state_bytes"] == 271360
    assert out["num_rows"] == 175371


def test_config_file_and_directory(tmp_path):
    raw = builtin_config_dict("kimi-k3.1")
    path = write_config(tmp_path, {"architectures": ["KimiK3ForCausalLM"], "text_config": raw})
    assert plan_json("--config", str(path))["block_size"] == 1024
    assert plan_json("--config", str(tmp_path), "-tp", "1")["block_size"] == 8192


# --- the text report ------------------------------------------------------------------------


def test_text_report_mentions_the_key_figures():
    result = run_plan()
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for figure in ("kimi-k3.1", "block size 1024", "18,912", "814,080", "1,210,368", "27,648", "786,432",
                   "states per row 23", "41,984", "1,159,936", "power of two ( 1024)"):
        assert figure in text, figure


def test_text_tp_table():
    # fp8 MLA + MXFP4 keys: 19 units at TP 1..8, 10 at TP 16 (reference 16), so TP 16 cannot exchange
    result = run_plan("-tp", "1,2,4,8,16", "--kv-cache-dtype", "fp8", "--attention-config",
                      '{"indexer_kv_dtype": "mxfp4"}')
    assert result.returncode == 0, result.stderr
    for figure in ("9728", "4864", "2432", "1216", "640", "yes", "no", "--reference-tp 16"):
        assert figure in result.stdout, figure


def test_text_tp_table_default_all_exchangeable():
    result = run_plan("-tp", "1,2,4,8,16")
    assert result.returncode == 0, result.stderr
    for figure in ("8192", "4096", "2048", "1024", "512", "yes"):
        assert figure in result.stdout, figure
    assert " no" not in result.stdout and "--reference-tp" not in result.stdout


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "layout.png"
    result = run_plan("--plot", str(path))
    assert result.returncode == 0, result.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_installed_entry_point():
    exe = Path(sys.executable).with_name("dsacache")
    if not exe.exists():
        pytest.skip("no installed dsacache entry point beside this python")
    result = subprocess.run([str(exe), "plan", "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["block_size"] == 1024


# --- no torch -------------------------------------------------------------------------------


def test_plan_does_not_import_torch_importtime():
    result = run_plan("--json", "-tp", "1,8", python_flags=("-X", "importtime"))
    assert result.returncode == 0
    modules = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "import time:" in line]
    assert "dsacache.planner" in modules  # the probe does see our imports
    assert not [m for m in modules if m == "torch" or m.startswith("torch.")]


def test_plan_does_not_import_torch_sys_modules():
    code = ("import sys, io, contextlib\n"
            "from dsacache.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['plan', '--json', '--speculative-config', "
            "'{\"method\": \"dspark\", \"num_speculative_tokens\": 2, \"model\": \"kimi-k3.1-dspark\"}'])\n"
            "assert rc == 0, rc\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- bad input: exit 2, one clear line, no traceback ----------------------------------------


def assert_refused(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    assert "error:" in result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


def assert_config_error(result, *needles):
    """A ConfigError: exactly one ``dsacache: error: ...`` line on stderr, nothing on stdout."""
    assert_refused(result, *needles)
    assert result.stderr.startswith("dsacache: error: ")
    assert result.stderr.strip().count("\n") == 0
    assert result.stdout == ""


def test_missing_config_file(tmp_path):
    assert_config_error(run_plan("--config", str(tmp_path / "nope.json")), "config file not found")


def test_directory_without_config_json(tmp_path):
    assert_config_error(run_plan("--config", str(tmp_path)), "config file not found", "config.json")


def test_malformed_config_json(tmp_path):
    path = write_config(tmp_path, '{"num_hidden_layers": 93, "kv_lora_rank": }')
    assert_config_error(run_plan("--config", str(path)), "malformed JSON")


def test_config_missing_field(tmp_path):
    raw = copy.deepcopy(builtin_config_dict("kimi-k3.1"))
    del raw["kv_lora_rank"]
    assert_config_error(run_plan("--config", str(write_config(tmp_path, raw))), "'kv_lora_rank'")


def test_overlapping_layers(tmp_path):
    raw = copy.deepcopy(builtin_config_dict("kimi-k3.1"))
    raw["linear_attn_config"]["kda_layers"].append(8)
    assert_config_error(run_plan("--config", str(write_config(tmp_path, raw))),
                        "[8]", "kda_layers", "full_attn_layers")


def test_unassigned_layers(tmp_path):
    raw = copy.deepcopy(builtin_config_dict("kimi-k3.1"))
    raw["linear_attn_config"]["full_attn_layers"].remove(93)
    assert_config_error(run_plan("--config", str(write_config(tmp_path, raw))),
                        "[93]", "neither", "num_hidden_layers=93")


def test_tp_not_dividing_kda_heads():
    assert_config_error(run_plan("--model", "kimi-linear-48b", "-tp", "8,3"),
                        "tensor_parallel_size=3", "32 KDA heads", "allowed: 1, 2, 4, 8, 16, 32")


@pytest.mark.parametrize("args,needles", [
    (["--kv-cache-dtype", "fp16"], ["--kv-cache-dtype", "invalid choice", "fp8_ds_mla"]),
    (["--target-arch", "sm70"], ["--target-arch", "invalid choice", "sm90"]),
    (["--model", "kimi-k3.1", "--config", "x.json"], ["not allowed with"]),
    (["-tp", "8,x"], ["tensor parallel size"]),
    (["-tp", "0"], ["tensor parallel sizes must be >= 1"]),
    (["--kv-cache-memory-bytes", "lots"], ["not a byte size"]),
    (["--context-length", "long"], ["--context-length"]),
])
def test_argparse_refusals(args, needles):
    assert_refused(run_plan(*args), *needles)


@pytest.mark.parametrize("args,needles", [
    (["--attention-config", '{"indexer_kv_dtype": "fp4"}'], ["indexer_kv_dtype='fp4'", "allowed: auto, fp8, mxfp4"]),
    (["--attention-config", '{"indexer_kv_dtype": mxfp4}'], ["--attention-config", "malformed JSON"]),
    (["--attention-config", '{"dtype": "mxfp4"}'], ["unknown keys", "allowed: indexer_kv_dtype"]),
    (["--speculative-config", "{method: dspark}"], ["--speculative-config", "malformed JSON"]),
    (["--speculative-config", '{"method": "lookahead", "num_speculative_tokens": 2}'],
     ["speculative_config.method='lookahead'", "allowed:"]),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], ["num_speculative_tokens"]),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "kv_cache_dtype": "int8"}'],
     ["speculative_config.kv_cache_dtype='int8'", "allowed:"]),
    (["--model", "deepseek-v3.2", "--attention-config", '{"indexer_kv_dtype": "mxfp4"}'],
     ["fused key insert", "index_rope_dim=64"]),
    (["--attention-config", '{"indexer_kv_dtype": "mxfp4"}', "--prefill-context-parallel-size", "2"],
     ["prefill_context_parallel_size=2"]),
    (["--attention-config", '{"indexer_kv_dtype": "mxfp4"}', "--indexer-backend", "deepgemm"],
     ["'deepgemm' cannot read MXFP4 keys on sm90", "sm100, sm103"]),
    (["--attention-config", '{"indexer_kv_dtype": "mxfp4"}', "--target-arch", "sm80"],
     ["cannot read MXFP4 keys on sm80"]),
    (["--decode-context-parallel-size", "3"], ["decode_context_parallel_size=3"]),
    (["--prefill-context-parallel-size", "0"], ["prefill_context_parallel_size must be an integer >= 1"]),
    (["--reference-tp", "0"], ["reference_tp must be an integer >= 1"]),
    (["--kv-cache-memory-bytes", "1MB"], ["holds no row", "one row is", "--kv-cache-memory-bytes"]),
    (["--kv-cache-memory-bytes", "100MB"], ["cannot hold one request", "--kv-cache-memory-bytes"]),
    (["--gpu-memory", "1GB"], ["cannot hold one request"]),
    (["--cache-fraction", "1.5"], ["--cache-fraction must be in (0, 1]"]),
    (["--context-length", "0"], ["context_length must be >= 1"]),
    (["--model", "kimi-k4"], ["kimi-k4"]),
])
def test_config_refusals(args, needles):
    assert_config_error(run_plan(*args), *needles)


@pytest.mark.parametrize("size", ["0", "0.5"])
def test_zero_budget_is_refused(size):
    assert_config_error(run_plan("--kv-cache-memory-bytes", size), "--kv-cache-memory-bytes")


def test_unknown_builtin_model_lists_allowed_names():
    assert_config_error(run_plan("--model", "kimi-k4"), "kimi-k4", "allowed", "kimi-k3.1", "kimi-linear-48b")


def test_plot_to_unwritable_path(tmp_path):
    pytest.importorskip("matplotlib")
    assert_config_error(run_plan("--plot", str(tmp_path / "missing-dir" / "x.png")), "--plot", "does not exist")
    assert not (tmp_path / "missing-dir").exists()


@pytest.mark.parametrize("option", ["--kv-cache-memory-bytes", "--gpu-memory"])
def test_overflowing_byte_size(option):
    assert_refused(run_plan(option, "1e400"), option)


def test_plan_under_dcp_reports_one_ranks_capacity(capsys):
    """DCP N: every rank keeps the same rows and block, a row covers N x block tokens of a request,
    so a 1M-token request needs N times fewer attention rows on each rank."""
    from dsacache.cli.main import main

    context = 1 << 20
    plans = {}
    for dcp in (1, 2, 4, 8):
        assert main(["plan", "--json", "--decode-context-parallel-size", str(dcp), "--context-length",
                     str(context)]) == 0
        plans[dcp] = json.loads(capsys.readouterr().out)
    base = plans[1]
    for dcp, p in plans.items():
        assert p["decode_context_parallel_size"] == dcp
        assert (p["block_size"], p["num_rows"]) == (base["block_size"], base["num_rows"])
        assert p["attention_rows_per_request"] == -(-context // (dcp * p["block_size"]))
        assert p["max_concurrent_requests"] == p["num_rows"] // (p["state_rows_per_request"]
                                                                 + p["attention_rows_per_request"])
    assert plans[8]["max_concurrent_requests"] > plans[1]["max_concurrent_requests"]
    assert main(["plan", "--decode-context-parallel-size", "4"]) == 0
    assert "DCP 4: a row covers 4,096 tokens, each rank storing its share" in capsys.readouterr().out
