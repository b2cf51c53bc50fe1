"""Tolerance helpers shared by kernel tests, and a fresh interpreter for compile-only checks."""

import os
import subprocess
import sys
from pathlib import Path

import torch


def rel_rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` over finite reference entries, in float64."""
    out, ref = out.double(), ref.double()
    mask = torch.isfinite(ref)
    num = (out[mask] - ref[mask]).norm()
    den = ref[mask].norm().clamp_min(1e-30)
    return float(num / den)


def calc_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``1 - 2<x, y> / (<x, x> + <y, y>)`` over finite reference entries (DeepGEMM-style)."""
    out, ref = out.double(), ref.double()
    mask = torch.isfinite(ref)
    x, y = out[mask], ref[mask]
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def run_compiled_script(script: str) -> str:
    """Run ``script`` in a fresh Python without ``TRITON_INTERPRET`` (the test process may run Triton
    interpreted, where kernels cannot be compiled) and return its stdout; fail with its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


#: Python source a ``run_compiled_script`` script can start with: ``usage(compiled)`` is
#: (registers a thread, spilled bytes, the whole report) from ptxas -v on the compiled kernel's
#: PTX for sm_90a.
PTXAS_USAGE = """
import os, re, subprocess, tempfile
import triton

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

def usage(compiled):
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        open(ptx, "w").write(compiled.asm["ptx"])
        done = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True, check=True)
    report = done.stdout + done.stderr
    spills = re.search(r"(\\d+) bytes spill stores, (\\d+) bytes spill loads", report)
    regs = int(re.search(r"Used (\\d+) registers", report).group(1))
    return regs, int(spills.group(1)) + int(spills.group(2)), report
"""


#: A tiny KDA-hybrid DSA model for CPU tests: 7 layers (DSA at 4 and 7, KDA elsewhere), 4 KDA heads
#: of 16 with a width-4 conv, an indexer of 4 x 32 with LayerNorm keys; rows are a few hundred KB.
TINY_HYBRID = {
    "num_hidden_layers": 7,
    "kv_lora_rank": 128,
    "qk_rope_head_dim": 0,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6], "full_attn_layers": [4, 7],
        "num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
    },
    "dsa_config": {"index_n_heads": 4, "index_head_dim": 32, "index_topk": 64,
                   "index_k_norm_type": "layernorm", "index_rope_dim": 0},
}
