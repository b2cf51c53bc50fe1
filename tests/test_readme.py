"""Every code block of the README runs as written.

Python blocks run in a fresh namespace; a ``print(...)`` line with a trailing comment must print
what the comment says (numbers and names compared, punctuation and ``torch.Size`` ignored).
Bash blocks: each ``dsacache ...`` command runs through the CLI's ``main`` and must exit 0;
``make`` lines are the set-up itself (CI runs ``make test``).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from dsacache.cli.main import main

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCK.findall(README.read_text()) if kind == lang]


def _words(text: str) -> list[str]:
    return re.findall(r"[\w.+-]+", text.replace("torch.Size", ""))


def _expected_prints(code: str) -> list[str]:
    return [line.split("#", 1)[1] for line in code.splitlines()
            if line.lstrip().startswith("print(") and "#" in line]


@pytest.mark.parametrize("code", blocks("python"), ids=lambda c: c.splitlines()[0][:40])
def test_python_block_runs(code):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    printed = [line for line in out.getvalue().splitlines() if line.strip()]
    for want, got in zip(_expected_prints(code), printed):
        assert _words(got) == _words(want), (want, got)


def _commands() -> list[list[str]]:
    out = []
    for body in blocks("bash"):
        for line in body.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line.startswith("dsacache "):
                out.append(shlex.split(line)[1:])
    return out


@pytest.mark.parametrize("argv", _commands(), ids=lambda a: " ".join(a)[:60])
def test_cli_command_runs(argv, capsys):
    try:
        status = main(argv)
    except SystemExit as done:  # --help exits through argparse
        status = done.code
    assert status in (0, None), capsys.readouterr().err


def test_the_readme_has_runnable_blocks():
    assert len(blocks("python")) >= 2 and len(_commands()) >= 6
