"""Every results file names the code it measured, and says so at its top when
that code has changed since (docs/results/)."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks.common import DEFAULT_OUT, REPO, STALE_MARK
from benchmarks.run import BENCHMARKS


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                          check=False)


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_a_results_file_is_current_or_says_it_is_not(name: str) -> None:
    data = json.loads((DEFAULT_OUT / f"{name}.json").read_text())
    text = (DEFAULT_OUT / f"{name}.md").read_text()
    assert not data["smoke"], "a smoke run's figures mean nothing"
    code = data.get("code") or {}
    assert code.get("commit"), "the file does not name the commit it measured"
    assert data["machine"]["cpu_model"] in text and data["date"] in text
    assert f"`{code['commit'][:12]}`" in text
    stale = STALE_MARK in text.split("\n## ", 1)[0]
    if code["dirty"]:
        assert stale, "measured uncommitted code: the commit does not name what ran"
        return
    if _git("cat-file", "-e", f"{code['commit']}^{{commit}}").returncode != 0:
        pytest.skip(f"commit {code['commit'][:12]} is not in this clone's history")
    changed = _git("diff", "--name-only", code["commit"], "HEAD", "--", *code["measures"])
    assert changed.returncode == 0, changed.stderr
    paths = changed.stdout.split()
    assert stale or not paths, (
        f"{name}: {', '.join(paths[:5])} changed since {code['commit'][:12]}: rerun "
        f"`python -m benchmarks.run {name}`, or put {STALE_MARK!r} at the file's top")
