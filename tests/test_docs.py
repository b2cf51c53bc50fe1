"""The docs stand alone: every repository path and relative link they name exists.

Scans ``README.md`` and ``docs/*.md`` for paths starting with ``docs/``, ``src/`` or
``tests/`` (in prose, inline code or code blocks) and for relative Markdown links, and
checks each against the working tree. Also: no doc cites the planning notes that live
outside the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

#: A repository path: starts at a top-level folder, not in the middle of another path or word.
REPO_PATH = re.compile(r"(?<![\w./-])((?:docs|src|tests)/[\w./-]*)")
#: A Markdown link or image target: ``[text](target)``.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: Files that are not in the repository and must not be cited.
OUTSIDE = ("packing.md", "targets.md", "shared/spec", "../shared")


def repo_paths(text: str) -> list[str]:
    """Every repository path named in ``text``, without trailing sentence punctuation."""
    return [m.rstrip(".") for m in REPO_PATH.findall(text)]


def relative_links(text: str) -> list[str]:
    """Markdown link targets that point into the tree (no URL scheme, no pure anchor), anchor removed."""
    targets = (t.split("#", 1)[0] for t in LINK.findall(text))
    return [t for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_scanners_find_what_they_should():
    text = "See `docs/layout.md`, src/dsacache/bench/harness.py. and [x](formats.md#top), [y](https://a/b)," \
           " not PYTHONPATH=src:x or foo/docs/y"
    assert repo_paths(text) == ["docs/layout.md", "src/dsacache/bench/harness.py"]
    assert relative_links(text) == ["formats.md"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_repo_paths_exist(doc: Path):
    missing = sorted({p for p in repo_paths(doc.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    missing = sorted({t for t in relative_links(doc.read_text()) if not (doc.parent / t).exists()})
    assert not missing, f"{doc.relative_to(ROOT)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_citation_outside_the_repository(doc: Path):
    text = doc.read_text()
    cited = [name for name in OUTSIDE if name in text]
    assert not cited, f"{doc.relative_to(ROOT)} cites files outside the repository: {cited}"


def test_code_cites_only_repository_docs():
    """Source and tests point to docs/ for the facts they rely on, never to notes outside the repository."""
    cited = []
    for path in sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]):
        if path.name == "test_docs.py":
            continue
        text = path.read_text()
        cited += [f"{path.relative_to(ROOT)}: {name}" for name in OUTSIDE if name in text]
        cited += [f"{path.relative_to(ROOT)}: bare formats.md" for _ in re.finditer(r"(?<!docs/)\bformats\.md", text)]
    assert not cited, cited
