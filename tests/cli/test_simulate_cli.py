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
    result = run_cli("simulate", "--json", "--no-progress", "--seed", "3")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    packed, pow2 = report["results"]
    assert (packed["name"], pow2["name"]) == ("packed", "power-of-two")
    assert (packed["block_size"], pow2["block_size"]) == (1216, 2048)
    for res in (packed, pow2):
        assert res["finished"] + res["rejected"] == report["workload"]["num_requests"]
        assert 0 < res["utilisation"] <= 1
    # Same memory, less waste per state row: the packed layout keeps more requests running.
    assert packed["peak_running"] > pow2["peak_running"]


def test_simulate_text_without_a_terminal_draws_no_progress_bar():
    result = run_cli("simulate", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert "peak concurrency" in result.stdout and "power-of-two" in result.stdout
    assert result.stderr == ""  # stderr is a pipe here; tests/cli/test_hardening.py draws the bar on a tty


def test_simulate_refuses_a_tp_list():
    result = run_cli("simulate", "-tp", "4,8")
    assert result.returncode == 2
    assert result.stderr.startswith("dsacache: error:") and "Traceback" not in result.stderr
