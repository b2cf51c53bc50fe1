"""Issue 17 through the command line: a bad input is exit 2 and one ``dsacache: error:`` line,
in bounded time; a closed pipe ends quietly; no setting is silently ignored.

Most runs call ``main(argv)`` in-process (fast); a few run the real entry point in a
subprocess (closed pipes, file permissions). ``simulate`` runs in-process replay a small
workload (``default_workload`` patched) so that each example stays far under the 2 s bound.
"""

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsacache.sim
from dsacache.cli.main import EXIT_BROKEN_PIPE, main
from dsacache.config.model import MAX_NUM_LAYERS, builtin_config_dict
from dsacache.sim import Workload

SRC = Path(__file__).resolve().parents[2] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
BOUND_S = 2.0


def small_workload(seed=0):
    return Workload(num_requests=12, arrival_rate=4.0, prompt_len_median=300, prompt_len_max=2048,
                    output_len_median=8, output_len_max=32, shared_prefix_len=256, seed=seed)


@pytest.fixture
def small_sim(monkeypatch):
    monkeypatch.setattr(dsacache.sim, "default_workload", small_workload)


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run(argv, stderr=None):
    """(status, stdout, stderr, seconds) of ``main(argv)`` in-process."""
    out, err = io.StringIO(), stderr if stderr is not None else io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([str(a) for a in argv])
    return status, out.getvalue(), err.getvalue(), time.perf_counter() - start


def check_outcome(status, out, err, seconds):
    assert "Traceback" not in out + err
    assert seconds < BOUND_S, seconds
    assert status in (0, 2), (status, err)
    if status == 2:
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("dsacache: error: "), err
        assert out == ""


def refused(argv, *needles):
    status, out, err, seconds = run(argv)
    check_outcome(status, out, err, seconds)
    assert status == 2, (out, err)
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def write(tmp_path, raw, name="config.json"):
    path = tmp_path / name
    if isinstance(raw, bytes):
        path.write_bytes(raw)
    else:
        path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return path


def hybrid_raw(num_layers=8, heads=8):
    full = list(range(4, num_layers + 1, 4))
    return {
        "num_hidden_layers": num_layers, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "linear_attn_config": {"kda_layers": [i for i in range(1, num_layers + 1) if i not in full],
                               "full_attn_layers": full, "num_heads": heads, "head_dim": 64,
                               "short_conv_kernel_size": 4},
        "dsa_config": {"index_n_heads": 4, "index_head_dim": 128, "index_topk": 64,
                       "index_k_norm_type": "layernorm", "index_rope_dim": 0},
    }


# --- class 2: bounded work --------------------------------------------------------------------


@pytest.mark.parametrize("command", ["plan", "simulate"])
@pytest.mark.parametrize("layers", [10**12, MAX_NUM_LAYERS + 1])
def test_absurd_layer_count(tmp_path, command, layers):
    for raw in ({"num_hidden_layers": layers, "kv_lora_rank": 512}, {**hybrid_raw(), "num_hidden_layers": layers}):
        refused([command, "--config", write(tmp_path, raw)], "num_hidden_layers", "4,096", "MAX_NUM_LAYERS")


def test_layer_limit_plans_in_bounded_time(tmp_path):
    path = write(tmp_path, {"num_hidden_layers": MAX_NUM_LAYERS, "kv_lora_rank": 512})
    status, out, err, seconds = run(["plan", "--config", path, "--json", "--kv-cache-memory-bytes", "1TiB"])
    check_outcome(status, out, err, seconds)
    assert status == 0 and len(json.loads(out)["layout"]["attention_layers"]) == MAX_NUM_LAYERS


def test_huge_prime_head_count(tmp_path):
    path = write(tmp_path, hybrid_raw(heads=1_000_000_007))
    refused(["plan", "--config", path, "-tp", "7"], "tensor_parallel_size=7", "1000000007 KDA heads", "allowed: 1")


def test_simulate_pool_with_too_many_rows(tmp_path):
    path = write(tmp_path, {"num_hidden_layers": 1, "kv_lora_rank": 128})
    refused(["simulate", "--config", path, "--kv-cache-memory-bytes", "1TiB"], "at most 1,048,576 rows",
            "--kv-cache-memory-bytes")


# --- class 3: tracebacks ----------------------------------------------------------------------


def test_unreadable_config_in_process(tmp_path, monkeypatch):
    path = write(tmp_path, builtin_config_dict("kimi-k3.1"))

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(path), "open", refuse)
    refused(["plan", "--config", path], "--config", "config.json", "Permission denied")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 file (the in-process test emulates it)")
def test_unreadable_config_subprocess(tmp_path):
    path = write(tmp_path, builtin_config_dict("kimi-k3.1"))
    path.chmod(0)
    result = subprocess.run([sys.executable, "-m", "dsacache", "plan", "--config", str(path)],
                            capture_output=True, text=True, env=ENV, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "Permission denied" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("body", ["[" * 50_000 + "]" * 50_000, '{"a": ' * 50_000 + "1" + "}" * 50_000])
def test_deeply_nested_config(tmp_path, body):
    refused(["plan", "--config", write(tmp_path, body)], "--config", "nested too deeply")


def test_deeply_nested_json_options():
    deep = "[" * 50_000 + "]" * 50_000
    refused(["plan", "--attention-config", deep], "--attention-config", "nested too deeply")
    refused(["plan", "--speculative-config", deep], "--speculative-config", "nested too deeply")


def test_out_of_memory_and_recursion_are_one_line(monkeypatch):
    for exc, needle in ((MemoryError, "out of memory"), (RecursionError, "nested too deeply")):
        def boom(*args, exc=exc, **kwargs):
            raise exc()

        monkeypatch.setattr("dsacache.planner.plan", boom)
        refused(["plan"], needle)


def test_ctrl_c_exits_130_quietly(monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("dsacache.planner.plan", interrupt)
    status, out, err, _ = run(["plan"])
    assert (status, out, err) == (130, "", "")


# simulate's default workload takes seconds: the subprocess runs main() with the small one
_SMALL_SIM = ("import sys, dsacache.sim, dsacache.sim.workload as w; from dsacache.cli.main import main; "
              "dsacache.sim.default_workload = lambda seed=0: w.Workload(num_requests=12, prompt_len_median=300, "
              "output_len_median=8, shared_prefix_len=256, seed=seed); sys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize("argv", [
    ["plan"], ["plan", "--json"], ["plan", "-tp", "1,2,4,8"], ["plan", "--model", "kimi-linear-48b"],
    ["simulate"], ["simulate", "--json"], ["bench", "--help"], ["--help"],
])
def test_closed_pipe_ends_quietly(argv):
    """The reader has gone before the command writes (as ``| head`` does after its lines)."""
    entry = ["-c", _SMALL_SIM] if argv[0] == "simulate" else ["-m", "dsacache"]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, *entry, *argv], stdout=write_end, stderr=subprocess.PIPE,
                                text=True, env=ENV, timeout=120)
    finally:
        os.close(write_end)
    assert result.returncode in (0, EXIT_BROKEN_PIPE), result.stderr
    assert result.stderr == ""


def test_pipe_into_head_keeps_the_first_lines():
    result = subprocess.run(f"{sys.executable} -m dsacache plan -tp 1,2,4,8,16 | head -1", shell=True,
                            capture_output=True, text=True, env=ENV, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("TP ") and result.stderr == ""


# --- class 4: messages and quiet acceptance ---------------------------------------------------


@pytest.mark.parametrize("argv,needles", [
    (["plan", "--model", ""], ["--model ''", "not a built-in model"]),
    (["plan", "--config", ""], ["--config", "empty"]),
    (["plan", "--attention-config", ""], ["--attention-config", "malformed JSON"]),
    (["plan", "--speculative-config", ""], ["--speculative-config", "malformed JSON"]),
    (["plan", "--plot", ""], ["--plot", "file name"]),
    (["plan", "--plot", "   "], ["--plot", "file name"]),
    (["simulate", "--model", ""], ["--model ''"]),
])
def test_empty_values_are_refused(argv, needles):
    refused(argv, *needles)


def test_binary_config_names_file_and_option(tmp_path):
    path = write(tmp_path, b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    refused(["plan", "--config", path], "--config", str(path), "not UTF-8")


def test_config_that_is_not_a_file(tmp_path):
    refused(["plan", "--config", "/dev/null"], "--config", "not a regular file")
    refused(["plan", "--config", "a\0b"], "--config", "cannot read")


@pytest.mark.parametrize("budget", ["1", "1MB"])
def test_simulate_tiny_budget_names_the_budget(budget, small_sim):
    refused(["simulate", "--kv-cache-memory-bytes", budget], "--kv-cache-memory-bytes", "holds no row",
            "one row is")


@pytest.mark.parametrize("argv", [
    [], ["nope"], ["plan", "--bogus"], ["plan", "-tp"], ["plan", "-tp", "x"], ["plan", "-tp", "8,8"],
    ["plan", "-tp", ",".join(["1"] * 40)], ["plan", "--kv-cache-dtype", "int4"], ["plan", "--context-length", "1.5"],
    ["plan", "--config", "a", "--model", "b"], ["simulate", "--seed", "x"], ["simulate", "--json", "extra"],
    ["plan", "--kv-cache-memory-bytes", "12 parsecs"], ["bench"], ["bench", "nope"], ["bench", "kcache", "--bogus"],
])
def test_argument_errors_are_one_line(argv):
    err = refused(argv)
    assert "--help" in err


def test_argument_error_subprocess_is_one_line():
    result = subprocess.run([sys.executable, "-m", "dsacache", "simulate", "--bogus"], capture_output=True,
                            text=True, env=ENV, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "dsacache: error: unrecognized arguments: --bogus (see 'dsacache simulate --help')\n"


def test_help_still_prints_usage():
    status, out, err, _ = run(["plan", "--help"])
    assert status == 0 and out.startswith("usage: dsacache plan") and err == ""


def test_plan_and_simulate_print_the_budget_in_one_unit(small_sim):
    _, plan_out, _, _ = run(["plan", "--kv-cache-memory-bytes", "48GiB"])
    _, sim_out, _, _ = run(["simulate", "--kv-cache-memory-bytes", "48GiB"])
    assert "budget 48.00 GiB = 51,539,607,552 B per GPU" in plan_out
    assert " GiB per rank" in sim_out
    for text in (plan_out, sim_out):
        assert " GB" not in text and " MB" not in text


def test_progress_bar_only_on_a_terminal(small_sim):
    status, out, err, _ = run(["simulate"])
    assert status == 0 and err == ""
    status, out, err, _ = run(["simulate"], stderr=Terminal())
    assert status == 0 and "100%" in err and "packed" in err
    status, out, err, _ = run(["simulate", "--no-progress"], stderr=Terminal())
    assert status == 0 and err == ""


# --- class 5: the front door ------------------------------------------------------------------


def test_bench_help_in_process():
    status, out, err, _ = run(["bench", "--help"])
    assert status == 0 and err == ""
    assert out.startswith("usage: dsacache bench") and all(s in out for s in ("kcache", "logits", "topk"))


def test_bench_help_is_the_same_as_python_m_dsacache_bench():
    via_cli = subprocess.run([sys.executable, "-m", "dsacache", "bench", "--help"], capture_output=True, text=True,
                             env=ENV, timeout=120)
    direct = subprocess.run([sys.executable, "-m", "dsacache.bench", "--help"], capture_output=True, text=True,
                            env=ENV, timeout=120)
    assert via_cli.returncode == direct.returncode == 0
    assert via_cli.stdout == direct.stdout and "kcache" in via_cli.stdout


def test_top_level_help_lists_bench():
    status, out, _, _ = run(["--help"])
    assert status == 0 and "bench" in out


# --- class 4 and 8: the plot ------------------------------------------------------------------


@pytest.fixture
def figures(monkeypatch):
    """The figures ``--plot`` saves, kept for inspection."""
    figure = pytest.importorskip("matplotlib.figure")
    saved, real = [], figure.Figure.savefig

    def keep(self, *args, **kwargs):
        saved.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(figure.Figure, "savefig", keep)
    return saved


@pytest.mark.parametrize("name", ["plot", "plot.xyz", "plot.PNG.bak", "plot."])
def test_plot_without_a_known_extension_is_refused(tmp_path, name, figures):
    err = refused(["plan", "--plot", tmp_path / name], "--plot", ".png, .svg, .pdf")
    assert name in err
    assert list(tmp_path.iterdir()) == [] and figures == []


def test_plot_into_a_directory_is_refused(tmp_path, figures):
    refused(["plan", "--plot", tmp_path], "--plot", "is a directory", "plan.png")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name,magic", [("a.png", b"\x89PNG"), ("b.svg", b"<?xml"), ("c.PDF", b"%PDF")])
def test_plot_writes_exactly_the_path_it_prints(tmp_path, name, magic, figures):
    path = tmp_path / name
    status, out, err, _ = run(["plan", "--plot", path])
    assert status == 0 and err == f"wrote {path}\n"
    assert [p.name for p in tmp_path.iterdir()] == [name] and path.read_bytes().startswith(magic)


def test_paged_capacity_bar_is_not_labelled_packed(tmp_path, figures):
    status, _, _, _ = run(["plan", "--model", "deepseek-v3.2", "--plot", tmp_path / "p.png"])
    assert status == 0
    capacity = figures[0].axes[1]
    labels = [t.get_text() for t in capacity.get_yticklabels()]
    assert labels == ["paged\n64-token pages"]
    assert "paged layout" in figures[0].axes[0].get_title()


def test_packed_capacity_bars(tmp_path, figures):
    run(["plan", "--plot", tmp_path / "p.png"])
    labels = [t.get_text() for t in figures[0].axes[1].get_yticklabels()]
    assert labels[0].startswith("packed\nblock ") and labels[1].startswith("power of two\nblock ")


def test_plot_with_a_tp_list_says_what_it_draws(tmp_path, figures):
    path = tmp_path / "tp.png"
    status, _, err, _ = run(["plan", "-tp", "2,4,8", "--plot", path])
    assert status == 0
    assert err == f"note: --plot draws TP 2 only (the first of the list)\nwrote {path}\n"
    title = figures[0].axes[0].get_title()
    assert "TP 2 (TP 4, 8 not drawn)" in title


# --- the property: random config.json documents and option sets -------------------------------

_LEAF = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.integers(-2**70, 2**70),
    st.sampled_from([0, 1, -1, 2, 3, 4, 7, 8, 32, 64, 96, 128, 512, 2**31, 10**12, 10**100, MAX_NUM_LAYERS + 1]),
)
_JSON = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                                           max_size=5), max_leaves=25)
#: Values a real config.json could hold: small numbers, layer lists, the norm names.
_PLAUSIBLE = st.one_of(
    st.sampled_from([1, 2, 4, 8, 16, 32, 64, 96, 128, 256, 512, 1024, 2048, "layernorm", "rmsnorm"]),
    st.lists(st.integers(1, 16), max_size=8, unique=True),
)
_KEYS = [
    ("num_hidden_layers",), ("kv_lora_rank",), ("qk_rope_head_dim",), ("linear_attn_config",),
    ("linear_attn_config", "kda_layers"), ("linear_attn_config", "full_attn_layers"),
    ("linear_attn_config", "num_heads"), ("linear_attn_config", "head_dim"),
    ("linear_attn_config", "short_conv_kernel_size"), ("dsa_config",), ("dsa_config", "index_n_heads"),
    ("dsa_config", "index_head_dim"), ("dsa_config", "index_topk"), ("dsa_config", "index_k_norm_type"),
    ("dsa_config", "index_rope_dim"), ("index_n_heads",), ("text_config",),
]


@st.composite
def mutated_configs(draw):
    """A built-in or small hybrid config with a few fields replaced by random JSON or deleted."""
    raw = draw(st.sampled_from(["kimi-k3.1", "kimi-linear-48b", "deepseek-v3.2", "kimi-k3.1-dspark", "hybrid"]))
    raw = hybrid_raw(draw(st.sampled_from([4, 8, 12])), draw(st.sampled_from([1, 3, 8, 96]))) if raw == "hybrid" \
        else builtin_config_dict(raw)
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 4]))):
        path = draw(st.sampled_from(_KEYS))
        node = raw
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        if draw(st.booleans()) and path[-1] in node:
            del node[path[-1]]
        else:
            node[path[-1]] = draw(_PLAUSIBLE | _JSON)
    if draw(st.integers(0, 4)) == 0:
        raw = {"text_config": raw}
    return raw


CONFIG_DOCS = st.one_of(
    mutated_configs(), mutated_configs(), _JSON,
    st.binary(max_size=64),
    st.sampled_from(['{"num_hidden_layers": ' + "9" * 5000 + "}", "[" * 5000 + "]" * 5000, "", "{", "\ufeff{}"]),
)


def _option(name, values):
    """``[name, value]``: mostly one of ``values``, sometimes random text."""
    listed = st.sampled_from(values)
    return st.one_of(*[listed] * 6, st.text(max_size=8)).map(lambda v: [name, v])


MODEL_OPTIONS = [
    _option("-tp", ["1", "2", "4", "8", "16", "3", "0", "-1", "1,2,4,8", "8,8", "", "99999999999999"]),
    _option("--kv-cache-dtype", ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla", "int8"]),
    _option("--attention-config", ['{"indexer_kv_dtype": "mxfp4"}', '{"indexer_kv_dtype": "fp8"}', "{}", "[]",
                                   '{"indexer_kv_dtype": 4}', "null", '{"x": 1}']),
    _option("--speculative-config", ['{"method": "mtp", "num_speculative_tokens": 1}',
                                     '{"method": "dspark", "num_speculative_tokens": 3, "model": "kimi-k3.1-dspark"}',
                                     '{"method": "eagle3", "num_speculative_tokens": 2, "draft_config": {}}',
                                     '{"method": "dspark", "num_speculative_tokens": 3, "model": ""}',
                                     '{"method": "ngram", "num_speculative_tokens": 99999999999}', "{}"]),
    _option("--prefill-context-parallel-size", ["1", "2", "0", "100000"]),
    _option("--decode-context-parallel-size", ["1", "2", "4", "8", "3", "0"]),
    _option("--target-arch", ["sm90", "sm100", "sm80", "gfx950", "sm999"]),
    _option("--indexer-backend", ["triton", "deepgemm", "flashinfer"]),
    _option("--reference-tp", ["8", "16", "0", "3", "65537"]),
    _option("--kv-cache-memory-bytes", ["1", "1MB", "100MB", "8GiB", "48GiB", "8TiB", "0", "1e400", "-5", "x"]),
    _option("--gpu-memory", ["141GB", "80GiB", "1", "1e18"]),
    _option("--cache-fraction", ["0.35", "0", "1", "1.5", "nan", "inf", "-1"]),
    _option("--model", ["kimi-k3.1", "kimi-linear-48b", "deepseek-v3.2", "", "gpt-5"]),
]
PLAN_OPTIONS = MODEL_OPTIONS + [
    _option("--context-length", ["1", "4096", "32768", "0", "-3", "1" + "0" * 30]),
    st.just(["--json"]),
]
SIM_OPTIONS = MODEL_OPTIONS + [_option("--seed", ["0", "7", "-1", "x"]), st.just(["--json"]),
                               st.just(["--no-progress"])]


def option_sets(pool):
    return st.lists(st.one_of(pool), max_size=5).map(lambda groups: [a for g in groups for a in g])


@pytest.fixture(scope="module")
def doc_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _fuzz(command, doc, options, doc_dir):
    argv = [command, *options]
    if doc is not None and "--model" not in options:
        argv += ["--config", write(doc_dir, doc if isinstance(doc, (bytes, str)) else json.dumps(doc))]
    check_outcome(*run(argv))


@given(doc=st.none() | st.none() | CONFIG_DOCS, options=option_sets(PLAN_OPTIONS))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_random_plan_runs_exit_0_or_2_in_bounded_time(doc, options, doc_dir):
    _fuzz("plan", doc, options, doc_dir)


@given(doc=st.none() | st.none() | CONFIG_DOCS, options=option_sets(SIM_OPTIONS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def test_random_simulate_runs_exit_0_or_2_in_bounded_time(doc, options, doc_dir):
    with mock.patch.object(dsacache.sim, "default_workload", small_workload):
        _fuzz("simulate", doc, options, doc_dir)
