"""What a new user meets first with `run` and `demo`: a job that dies at once is
reported with its exit code, the end of a run says why the terminal is still
held (and is not held when nothing scraped), and the demo's warm-up is the
documented default."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import agent_env, free_port, wait_for
from tests.helpers import SCRAPE_TIMEOUT_SECONDS


def agent(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dlprof_agent", *args], env=agent_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_run_of_a_job_that_dies_at_import_says_it_exited_with_its_code() -> None:
    # -I: a Python that ignores PYTHONPATH, so no probe, like one without dlprof-agent;
    # the import fails as a job's `import torch` does where torch is missing.
    result = agent("run", "--port", "0", "--", sys.executable, "-I", "-c",
                   "import a_module_this_python_lacks")
    assert result.returncode == 1
    assert "ModuleNotFoundError" in result.stderr  # the job's own error, untouched
    assert "exited with code 1" in result.stderr
    assert "--no-inject" not in result.stderr


@pytest.mark.slow  # a job and its agent for seconds
def test_run_without_a_scraper_ends_with_the_job_and_says_so() -> None:
    started = time.monotonic()
    result = agent("run", "--port", "0", "--", sys.executable, "-c",
                   "import time; time.sleep(1.5)")
    assert result.returncode == 0, result.stderr
    assert "exited with code 0; nothing has scraped /metrics, so the agent stops now" \
        in result.stderr
    assert time.monotonic() - started < 15  # not the 15 s grace


@pytest.mark.slow  # a job and its agent for seconds
def test_run_that_was_scraped_says_why_it_holds_the_terminal() -> None:
    port = free_port()
    run = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "run", "--port", str(port), "--grace", "2",
         "--", sys.executable, "-c", "import time; time.sleep(4)"],
        env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_SECONDS).status == 200,
            "a scrape")
        _, stderr = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, stderr
    assert ("exited with code 0; serving dlprof_target_up 0 for 2 s more, so that the next "
            "scrape sees it (Ctrl-C stops now; --grace sets how long)") in stderr


@pytest.mark.slow  # trains with torch
def test_demo_warms_up_for_the_documented_default_of_10_steps() -> None:
    pytest.importorskip("torch")
    result = agent("demo", "--duration", "8", "--port", "0", "--threads", "1")
    assert result.returncode == 0, result.stderr
    summary = next(line for line in result.stdout.splitlines()
                   if line.strip().startswith("steps"))
    assert "(+10 warm-up)" in summary


def test_the_readme_and_the_parser_agree_on_the_warmup_default() -> None:
    from pathlib import Path

    from dlprof_agent.cli.main import build_parser
    from dlprof_agent.probe.messages import DEFAULT_WARMUP_STEPS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    documented = re.search(r"`--warmup-steps`\s+\(default (\d+)\)", readme)
    assert documented is not None and int(documented.group(1)) == DEFAULT_WARMUP_STEPS
    args = build_parser().parse_args(["attach", "1"])
    assert args.warmup_steps == DEFAULT_WARMUP_STEPS
