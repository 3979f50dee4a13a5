"""No squatting: a runtime directory someone else made first never stops the
probe, which makes a private one of its own; the agent finds the probe there,
past any socket planted where the probe would usually be."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlprof_agent.collectors.target import Target
from dlprof_agent.probe import server
from dlprof_agent.probe.protocol import socket_name
from dlprof_agent.probe_link.client import held_sockets, probe_socket_paths
from dlprof_agent.probe_link.connect import NoProbe, ProbeOptions, try_connect
from tests.conftest import REPO, agent_env

# A job whose probe finds every usual place taken: its candidates are only the
# directory given, which the test has made unusable (writable by all, as a
# squatter's would be, or another user's).
JOB = textwrap.dedent("""
    import sys, time
    from dlprof_agent.probe import server
    squatted = sys.argv[1]
    server.runtime_dir_candidates = lambda uid, environ: [squatted]
    print("ready", flush=True)
    sys.stdin.readline()
    import dlprof_agent.probe
    from dlprof_agent.probe import runtime
    started = dlprof_agent.probe.enable()
    probe = runtime.current()
    print(probe.path if started and probe is not None else "NONE", flush=True)
    time.sleep(300)
""")


@pytest.fixture
def squatted(tmp_path: Path) -> Path:
    """A runtime directory as a squatter leaves it: another user's where the test
    can make one (root), and in any case writable by every user."""
    directory = tmp_path / "run"
    directory.mkdir()
    directory.chmod(0o777)
    if os.geteuid() == 0:
        os.chown(directory, 65534, 65534)
    return directory


@pytest.fixture
def planted() -> Iterator[list[socket.socket]]:
    sockets: list[socket.socket] = []
    yield sockets
    for each in sockets:
        each.close()


def test_a_runtime_directory_made_by_someone_else_never_stops_the_probe(
        squatted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "runtime_dir_candidates", lambda uid, environ: [str(squatted)])
    probe = server.Probe(persistent=True)
    assert probe.listen()
    try:
        directory = Path(probe.path).parent
        assert directory != squatted
        info = directory.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
        assert stat.S_ISSOCK(Path(probe.path).stat().st_mode)
        # The agent's lookup finds it among the sockets the process holds.
        assert probe.path in held_sockets(os.getpid(), {socket_name(os.getpid())})
    finally:
        probe.close()
    assert not directory.exists()  # the probe's own directory goes with it


def start_job(squatted: Path) -> subprocess.Popen[str]:
    job = subprocess.Popen([sys.executable, "-c", JOB, str(squatted)], cwd=REPO,
                           env={**agent_env(), "DLPROF_AGENT_RUNTIME_DIR": str(squatted)},
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert job.stdout is not None and job.stdout.readline().strip() == "ready"
    return job


def enable(job: subprocess.Popen[str]) -> str:
    assert job.stdin is not None and job.stdout is not None
    job.stdin.write("go\n")
    job.stdin.flush()
    return job.stdout.readline().strip()


def plant(planted: list[socket.socket], path: Path) -> None:
    """A socket where the job's probe would usually be, served by a process
    that is not the job (this test)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    planted.append(listener)


def test_a_planted_socket_never_makes_the_agent_give_up_on_the_real_probe(
        squatted: Path, planted: list[socket.socket]) -> None:
    job = start_job(squatted)
    try:
        planted_path = squatted / socket_name(job.pid)
        plant(planted, planted_path)
        path = enable(job)
        assert path not in ("NONE", str(planted_path))
        assert list(probe_socket_paths(job.pid)) == [str(planted_path), path]
        client = try_connect(Target.of(job.pid), ProbeOptions(inject=False), 1.0, 5.0)
        try:
            assert client.hello["pid"] == job.pid
            assert client.snapshot().pid == job.pid
        finally:
            client.stop()
            client.close()
    finally:
        job.kill()
        job.wait()


def test_with_only_a_planted_socket_the_agent_says_it_refused_it(
        squatted: Path, planted: list[socket.socket]) -> None:
    """Until the real probe starts, the refusal is the reason given, and it is
    not final: the real probe may still come up elsewhere."""
    job = start_job(squatted)
    try:
        plant(planted, squatted / socket_name(job.pid))
        with pytest.raises(NoProbe) as refused:
            try_connect(Target.of(job.pid), ProbeOptions(inject=False), 1.0, 0.0)
        assert "impersonating" in str(refused.value)
        assert not refused.value.final
    finally:
        job.kill()
        job.wait()
