"""The README is a front door: short, opening with the two commands and the
picture; every relative link in it and in docs/*.md reaches a file, and a
link's #anchor a heading of that file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
MAX_README_LINES = 150


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped,
    spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.+)$", FENCE.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in headings}


def links(page: Path) -> list[str]:
    return [link for link in LINK.findall(FENCE.sub("", page.read_text()))
            if not re.match(r"[a-z]+:", link)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for link in links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no {target.relative_to(REPO)}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_the_readme_opens_with_the_two_commands_then_the_picture() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES
    assert lines[2:6] == [
        "```bash",
        "scripts/setup && .venv/bin/dlprof-agent demo           "
        "# set up, then watch the agent read a busy job",
        "scripts/setup && .venv/bin/python -m pytest            "
        "# set up, then run the tests (what CI runs)",
        "```"]
    first_text = next(line for line in lines[6:] if line and not line.startswith(("<!--", " ")))
    assert first_text.startswith("![") and "(docs/top.svg)" in first_text
    assert (REPO / "docs" / "top.svg").read_text().lstrip().startswith("<svg")
