"""`dsacache simulate` run as a real command."""

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[2] / "src")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-m", "dsacache", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_simulate_json_compares_packed_with_power_of_two():
    # MXFP4 keys: packed 1088 (17 units), power of two 2048. At the default FP8 keys both are 1024.
    result = run_cli("simulate", "--json", "--no-progress", "--seed", "3",
                     "--attention-config", '{"indexer_kv_dtype": "mxfp4"}')
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    packed, pow2 = report["results"]
    assert (packed["name"], pow2["name"]) == ("packed", "power-of-two")
    assert (packed["block_size"], pow2["block_size"]) == (1088, 2048)
    for res in (packed, pow2):
        assert res["finished"] + res["rejected"] == report["workload"]["num_requests"]
        assert 0 < res["utilisation"] <= 1
    # Same memory, less waste per state row: the packed layout keeps more requests running.
    assert packed["peak_running"] > pow2["peak_running"]


def test_simulate_default_blocks_coincide():
    # FP8 keys: 16 units -> 1024, and 512 x 18912 < 23 x 814,080 <= 1024 x 18912 -> power of two 1024
    result = run_cli("simulate", "--json", "--no-progress", "--seed", "3")
    assert result.returncode == 0, result.stderr
    packed, pow2 = json.loads(result.stdout)["results"]
    assert packed["block_size"] == pow2["block_size"] == 1024
    assert packed["peak_running"] == pow2["peak_running"]


def test_simulate_text_without_a_terminal_draws_no_progress_bar():
    result = run_cli("simulate", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert "peak concurrency" in result.stdout and "power-of-two" in result.stdout
    assert result.stderr == ""  # stderr is a pipe here; tests/cli/test_hardening.py draws the bar on a tty


def test_simulate_refuses_a_tp_list():
    result = run_cli("simulate", "-tp", "4,8")
    assert result.returncode == 2
    assert result.stderr.startswith("dsacache: error:") and "Traceback" not in result.stderr


def test_simulate_under_dcp_reports_one_ranks_pool(capsys):
    """DCP 2 (interleave 64): the same rows per rank, each covering twice the tokens, so more requests run."""
    from dsacache.cli.main import main

    def packed(*options):
        assert main(["simulate", "--json", "--no-progress", *options]) == 0
        report = json.loads(capsys.readouterr().out)
        return report, report["results"][0]

    report, dcp2 = packed("--decode-context-parallel-size", "2", "--cp-kv-cache-interleave-size", "64")
    assert report["decode_context_parallel_size"] == 2
    assert dcp2["tokens_per_row"] == 2 * dcp2["block_size"]
    assert dcp2["finished"] + dcp2["rejected"] == report["workload"]["num_requests"]
    assert 0 < dcp2["attention_row_utilisation"] <= 1
    _, dcp1 = packed()
    assert (dcp1["num_rows"], dcp1["block_size"]) == (dcp2["num_rows"], dcp2["block_size"])
    assert dcp2["peak_running"] > dcp1["peak_running"]


def test_simulate_refuses_a_bad_interleave():
    for value, match in (("0", "cp_kv_cache_interleave_size must be an integer >= 1"),
                         ("3", "cp_kv_cache_interleave_size=3 must divide the block size")):
        result = run_cli("simulate", "--no-progress", "--cp-kv-cache-interleave-size", value)
        assert result.returncode == 2
        assert result.stderr.startswith("dsacache: error:") and match in result.stderr, result.stderr
