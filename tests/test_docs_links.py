"""README.md and docs/*.md: every relative link reaches an existing file (and heading, for a
``#anchor``), every repository path written in backticks exists, and README keeps the two
commands CI and users run verbatim."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.text

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TWO_COMMANDS = [
    'bash scripts/setup.sh && .venv/bin/python scripts/generate.py --prompt "What is the capital of France?"',
    "bash scripts/setup.sh && .venv/bin/python -m pytest -q",
]


def _prose(path: Path) -> str:
    """The page without its fenced code blocks (links and headings in code do not count)."""
    return re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchor for each heading: lower case, punctuation dropped, spaces -> '-'."""
    heads = re.findall(r"^#+ (.*)$", _prose(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def _links() -> list[tuple[Path, str]]:
    return [(page, target) for page in PAGES for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page))
            if not target.startswith(("http://", "https://", "mailto:"))]


def test_pages_exist():
    assert (REPO / "README.md").is_file()
    assert len(PAGES) > 1, "docs/ has no pages"


@pytest.mark.parametrize("page,target", _links(), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_relative_link_resolves(page: Path, target: str):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page.resolve()
    assert dest.exists(), f"{page.relative_to(REPO)}: link {target!r} names a missing file"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), f"{page.relative_to(REPO)}: link {target!r} names a missing heading"


def test_backticked_repository_paths_exist():
    missing = []
    for page in PAGES:
        for m in re.findall(r"`((?:atlas_vlm|tests|scripts|benchmarks|deploy|mm_[a-z_]+|\.ci)/[\w./*-]+)`",
                            _prose(page)):
            if not (list(REPO.glob(m)) if "*" in m else (REPO / m).exists()):
                missing.append(f"{page.relative_to(REPO)}: {m}")
    assert missing == []


def test_readme_keeps_the_two_commands():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    for command in TWO_COMMANDS:
        assert command in lines, f"README.md lost the command {command!r}"
