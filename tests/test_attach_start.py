"""`attach` serves at once and reaches for the probe in the background: the
start's stop and progress with a stand-in channel, and real jobs that end at
several points of the probe's start (the attach then exits 0 with the summary)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dlprof_agent.collectors.target import Target
from dlprof_agent.probe_link import progress
from dlprof_agent.probe_link import start as probe_start
from dlprof_agent.probe_link.connect import ProbeOptions
from tests.conftest import agent_env, http_get
from tests.helpers import OWN_INJECTOR, wait_until


class StandInSource:
    stopped = False
    client = None

    def stop(self) -> None:
        self.stopped = True


def test_an_abandoned_start_stops_the_probe_it_reaches_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reaching, reached = threading.Event(), threading.Event()
    source = StandInSource()

    def opening(*args: object, **kwargs: object) -> StandInSource:
        reaching.set()
        reached.wait(10)  # an injection under way when the attach ends
        return source

    monkeypatch.setattr(probe_start, "open_probe", opening)
    monkeypatch.setattr(probe_start, "STOP_INJECTION_WAIT_SECONDS", 0.1)
    opened: list[object] = []
    start = probe_start.ProbeStart(Target(4242, 0),
                                   ProbeOptions(), interval=1.0, on_open=opened.append)
    start.start()
    assert reaching.wait(10)
    start.abandon()
    reached.set()
    assert wait_until(lambda: start.done, 10)
    assert source.stopped, "the probe reached after the attach ended was left in the job"
    assert start.source is None and not opened


def test_a_probe_that_comes_while_the_attach_stops_is_not_announced_after_the_stop(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # "dlprof-agent: stopped by SIGTERM" is printed first; the injection under way
    # then ends within abandon()'s wait: its "probe active" would come after it.
    reaching, reached = threading.Event(), threading.Event()
    source = StandInSource()
    source.client = type("Client", (), {"hello": {"frameworks": ["torch"]}})()

    def opening(*args: object, **kwargs: object) -> StandInSource:
        reaching.set()
        reached.wait(10)
        return source

    monkeypatch.setattr(probe_start, "open_probe", opening)
    caplog.set_level("INFO", logger="dlprof_agent")
    start = probe_start.ProbeStart(Target(4242, 0), ProbeOptions(), interval=1.0)
    start.start()
    assert reaching.wait(10)
    stopping = threading.Thread(target=start.abandon)
    stopping.start()
    assert wait_until(lambda: start._stopping, 10)
    reached.set()
    stopping.join(10)
    assert start.done and id(start.source) == id(source)  # handed over: the attach stops it
    assert not [r for r in caplog.records if "probe active" in r.getMessage()]


def test_the_channel_goes_to_the_sampler_and_the_note_says_what_is_awaited(
        monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    source = StandInSource()

    def opening(*args: object, **kwargs: object) -> StandInSource:
        progress.waiting_for(4242, "a thread of the job that waits in the kernel", tries=3)
        release.wait(10)
        progress.done(4242)
        return source

    monkeypatch.setattr(probe_start, "open_probe", opening)
    opened: list[object] = []
    start = probe_start.ProbeStart(Target(4242, 0),
                                   ProbeOptions(), interval=1.0, on_open=opened.append)
    start.start()
    assert wait_until(lambda: "waits in the kernel" in start.note(), 10)
    assert "try 3" in start.note()
    release.set()
    assert wait_until(lambda: start.done, 10)
    assert opened == [source] and id(start.source) == id(source) and start.note() == ""


def test_a_start_that_meets_another_agent_hands_its_error_over_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from dlprof_agent.errors import ProbeAlreadyAttached, TargetNotFound

    def busy(*args: object, **kwargs: object) -> None:
        raise ProbeAlreadyAttached("process 4242 already has an agent attached", "stop it")

    monkeypatch.setattr(probe_start, "open_probe", busy)
    start = probe_start.ProbeStart(Target(4242, 0), ProbeOptions(), interval=1.0)
    start.start()
    assert wait_until(lambda: start.done, 10)
    assert isinstance(start.failure(), ProbeAlreadyAttached) and start.failure() is None

    def gone(*args: object, **kwargs: object) -> None:
        raise TargetNotFound("process 4242 exited during the injection", "")

    monkeypatch.setattr(probe_start, "open_probe", gone)
    start = probe_start.ProbeStart(Target(4242, 0), ProbeOptions(), interval=1.0)
    start.start()
    assert wait_until(lambda: start.done, 10)
    assert start.failure() is None, "a job that ends is no error"


INJECTS = OWN_INJECTOR or (not hasattr(sys, "remote_exec") and shutil.which("gdb") is not None)

# Jobs whose probe's start takes seconds, each for another reason: no thread of it
# ever waits in the kernel (the injector waits for one); its main thread holds the
# GIL in a long C call (the probe is queued, and waits for it); and a job the probe
# reaches at once.
JOBS = {
    "busy": "print('ready', flush=True)\nwhile True:\n    pass\n",
    "holds-the-gil": ("import ctypes, threading\n"
                      "idle = threading.Lock(); idle.acquire()\n"
                      "threading.Thread(target=idle.acquire, daemon=True).start()\n"
                      "print('ready', flush=True)\n"
                      "ctypes.PyDLL(None).sleep(60)\n"),
    "steps": ("import time\nprint('ready', flush=True)\n"
              "while True:\n    sum(range(2000)); time.sleep(0.002)\n"),
}


@pytest.mark.slow  # starts real jobs and agents
@pytest.mark.skipif(not INJECTS, reason="the injector needs x86-64 or gdb before 3.14")
@pytest.mark.parametrize("kind", sorted(JOBS))
@pytest.mark.parametrize("after_seconds", [0.0, 0.4, 2.5])
def test_a_job_that_ends_during_the_probes_start_ends_the_attach_with_exit_0(
        tmp_path: Path, kind: str, after_seconds: float) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOBS[kind])
    job = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                           cwd=tmp_path, start_new_session=True)
    agent: subprocess.Popen[str] | None = None
    try:
        assert job.stdout is not None and job.stdout.readline() == "ready\n"
        agent = subprocess.Popen(
            [sys.executable, "-m", "dlprof_agent", "attach", str(job.pid), "--port", "0",
             "--grace", "0", "--no-gpu", "--interval", "0.2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env(),
            cwd=tmp_path)
        assert agent.stderr is not None
        lines: list[str] = []
        for line in agent.stderr:
            lines.append(line)
            if "attached to pid" in line:
                break
        assert lines and "attached to pid" in lines[-1], "".join(lines)
        assert "reaching for its probe in the background" in lines[-1]
        time.sleep(after_seconds)  # a point of the probe's start
        job.kill()
        job.wait(10)
        out, err = agent.communicate(timeout=60)
        messages = "".join(lines) + err
        assert agent.returncode == 0, messages
        assert f"summary for pid {job.pid} (the process exited)" in out, out + messages
        assert "while the agent was starting" not in messages
        assert "Traceback" not in messages
    finally:
        for process in (job, agent):
            if process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, 9)
                process.wait(10)


@pytest.mark.slow  # starts a real job and agent
@pytest.mark.skipif(not INJECTS, reason="the injector needs x86-64 or gdb before 3.14")
def test_a_slow_start_says_what_it_waits_for_and_what_the_user_can_do(tmp_path: Path) -> None:
    """Without a terminal there is no progress line: a start that takes seconds is
    said once, in a message."""
    script = tmp_path / "job.py"
    script.write_text(JOBS["holds-the-gil"])
    job = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                           cwd=tmp_path, start_new_session=True)
    agent: subprocess.Popen[str] | None = None
    try:
        assert job.stdout is not None and job.stdout.readline() == "ready\n"
        agent = subprocess.Popen(
            [sys.executable, "-m", "dlprof_agent", "attach", str(job.pid), "--port", "0",
             "--grace", "0", "--no-gpu", "--interval", "0.2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env(),
            cwd=tmp_path)
        assert agent.stderr is not None
        lines: list[str] = []
        for line in agent.stderr:
            lines.append(line)
            if "still reaching for the probe" in line:
                break
        said = lines[-1] if lines else ""
        assert "waiting for the queued probe to start" in said, "".join(lines)
        assert "Ctrl-C stops" in said and "/metrics serves" in said
        port = re.search(r"serving http://[^:]+:(\d+)/metrics", "".join(lines))
        assert port is not None
        health = json.loads(http_get(f"http://127.0.0.1:{port[1]}/healthz"))
        assert health["probe"]["state"] == "starting", health
        assert "waiting for the queued probe" in health["probe"]["reason"]
        job.kill()
        job.wait(10)
        _, err = agent.communicate(timeout=60)
        assert agent.returncode == 0, "".join(lines) + err
        assert "\r" not in "".join(lines) + err, "no progress line without a terminal"
    finally:
        for process in (job, agent):
            if process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, 9)
                process.wait(10)


@pytest.mark.slow  # starts a real job and agent
@pytest.mark.skipif(not INJECTS, reason="the injector needs x86-64 or gdb before 3.14")
def test_on_a_terminal_one_line_shows_what_the_start_waits_for(tmp_path: Path) -> None:
    import pty

    script = tmp_path / "job.py"
    script.write_text(JOBS["holds-the-gil"])
    job = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                           cwd=tmp_path, start_new_session=True)
    agent: subprocess.Popen[bytes] | None = None
    terminal, terminal_end = pty.openpty()
    try:
        assert job.stdout is not None and job.stdout.readline() == "ready\n"
        agent = subprocess.Popen(
            [sys.executable, "-m", "dlprof_agent", "attach", str(job.pid), "--port", "0",
             "--grace", "0", "--no-gpu", "--interval", "0.2"],
            stdout=subprocess.DEVNULL, stderr=terminal_end, env=agent_env(), cwd=tmp_path)
        os.close(terminal_end)
        shown = bytearray()

        def line_shown() -> bool:
            shown.extend(os.read(terminal, 4096))
            return b"\r\x1b[Kpid " in shown and b"waiting for the queued probe" in shown

        wait_until(line_shown, 60, what="the progress line")
        text = shown.decode(errors="replace")
        assert "reaching for the probe: waiting for" in text
    finally:
        for process in (job, agent):
            if process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, 9)
                process.wait(10)
        os.close(terminal)
