"""A probe socket is a file anyone may try to plant: the agent (root here) must
talk only to the job's own probe, and take from it only what a probe sends.

The impostor is a real second user (`nobody`, through setpriv) serving the
protocol on a real socket where the job's probe would be, for a real job; the
agents are real `attach` and `daemon` processes scraped over HTTP."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import OWN_JOBS, REPO, agent_env, free_port, http_get, wait_for

pytestmark = pytest.mark.e2e
SETPRIV = shutil.which("setpriv")
NOBODY = ["--reuid=65534", "--regid=65534", "--clear-groups"]

# Serves the probe protocol at PATH as a probe would, with made-up numbers: the
# steps and version an impostor would like exported, and LAYERS layer names.
FAKE_PROBE = textwrap.dedent("""
    import os, socket, sys, threading
    from dlprof_agent.probe.protocol import encode, read_frame
    path, layers, make_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "mkdir"
    if make_dir:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(8)
    print("serving", flush=True)
    snapshot = {"ok": True, "probe": {
        "step_source": "optimizer", "steps": {"steady": 123456789}, "samples": {},
        "step_buckets": [0.1], "step_bucket_counts": [0, 123456789],
        "step_seconds_sum": 1.0, "last_step_seconds": 0.1, "phase_seconds": {},
        "layers": [[f"layer{i}", 0.1, 1, 0.1, 1] for i in range(layers)],
        "hook_errors": 0}, "settings": {"torch": {"version": "FAKE-by-nobody"}},
        "dropped": {}}
    def serve(connection):
        with connection:
            while True:
                try:
                    command = read_frame(connection, max_bytes=1 << 16)["command"]
                except Exception:
                    return
                connection.sendall(encode(
                    {"ok": True, "version": 1, "pid": os.getpid(), "frameworks": ["torch"]}
                    if command == "start" else snapshot))
    while True:
        threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
""")
SLEEPER = "import time; print('ready', flush=True); time.sleep(300)"


def needs_root_and_setpriv() -> str:
    if os.geteuid() != 0 or SETPRIV is None:
        pytest.skip("needs root and setpriv to act as another user")
    return SETPRIV


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    """Where the job's probe would put its socket: a name no one holds yet, in
    /tmp, so that another user can be the first to create it."""
    parent = Path(tempfile.mkdtemp(prefix="dlprof-impostor-"))
    parent.chmod(0o1777)  # as /tmp is
    yield parent / "run"
    shutil.rmtree(parent, ignore_errors=True)


def start(processes: list[subprocess.Popen[str]], args: list[str],
          env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    process = subprocess.Popen(args, cwd=REPO, env=env or agent_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    processes.append(process)
    return process


def start_job(processes: list[subprocess.Popen[str]], runtime_dir: Path,
              script: str = SLEEPER, *args: str) -> subprocess.Popen[str]:
    job = start(processes, [sys.executable, "-c", script, *args],
                {**agent_env(), "DLPROF_AGENT_RUNTIME_DIR": str(runtime_dir)})
    assert job.stdout is not None
    assert job.stdout.readline().strip() in ("ready", "serving")
    return job


def plant(processes: list[subprocess.Popen[str]], path: Path, *, prefix: list[str],
          layers: int = 0) -> None:
    server = start(processes, [*prefix, sys.executable, "-c", FAKE_PROBE, str(path),
                               str(layers), "mkdir"])
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "serving", server.stderr


def attach(processes: list[subprocess.Popen[str]], pid: int, *args: str
           ) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    agent = start(processes, [sys.executable, "-m", "dlprof_agent", "attach", str(pid),
                              "--port", str(port), "--interval", "0.2", "--quiet", *args])
    wait_for(lambda: b"dlprof_target_up" in http_get(f"http://127.0.0.1:{port}/metrics"),
             "the agent's first sample")
    return agent, port


def scrape(port: int) -> str:
    return http_get(f"http://127.0.0.1:{port}/metrics").decode()


def stop_and_read(agent: subprocess.Popen[str]) -> str:
    agent.terminate()
    return agent.communicate(timeout=30)[1]


def samples(exposition: str, name: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines()
            if line.startswith((name + "{", name + " "))]


def assert_nothing_of_the_impostor(exposition: str) -> None:
    assert "123456789" not in exposition
    assert "FAKE-by-nobody" not in exposition
    assert not any(line.startswith("dlprof_layer") for line in exposition.splitlines())
    assert samples(exposition, "dlprof_probe_up") == [0.0]
    assert len(exposition.splitlines()) < 2_000


def serve_from_the_job(processes: list[subprocess.Popen[str]], runtime_dir: Path,
                       layers: int) -> subprocess.Popen[str]:
    """The job itself serves the fake probe, at its own pid's name: every check of
    whom the agent talks to passes, and only the reply's content can be refused."""
    runtime_dir.mkdir(mode=0o700)
    job = start(processes, [sys.executable, "-c",
                            "import os, sys; sys.argv[1] = sys.argv[1].replace('PID', "
                            "str(os.getpid())); exec(sys.argv.pop(4))",
                            str(runtime_dir / "probe-PID.sock"), str(layers), "no",
                            FAKE_PROBE],
                {**agent_env(), "DLPROF_AGENT_RUNTIME_DIR": str(runtime_dir)})
    assert job.stdout is not None and job.stdout.readline().strip() == "serving"
    return job


def test_a_socket_planted_by_another_user_in_a_folder_of_theirs_is_refused(
        processes: list[subprocess.Popen[str]], runtime_dir: Path) -> None:
    setpriv = needs_root_and_setpriv()
    job = start_job(processes, runtime_dir)
    plant(processes, runtime_dir / f"probe-{job.pid}.sock", prefix=[setpriv, *NOBODY],
          layers=20_001)
    agent, port = attach(processes, job.pid, "--no-inject")
    wait_for(lambda: "dlprof_probe_up" in scrape(port), "the probe's series")
    assert_nothing_of_the_impostor(scrape(port))
    stderr = stop_and_read(agent)
    assert "its directory belongs to uid 65534" in stderr, stderr
    assert "impersonating" in stderr


def test_a_planted_socket_in_the_jobs_own_folder_is_refused_by_its_peers_credentials(
        processes: list[subprocess.Popen[str]], runtime_dir: Path) -> None:
    """The folder and the socket file pass for the job's: only SO_PEERCRED tells."""
    setpriv = needs_root_and_setpriv()
    job = start_job(processes, runtime_dir)
    path = runtime_dir / f"probe-{job.pid}.sock"
    plant(processes, path, prefix=[setpriv, *NOBODY])
    os.chown(runtime_dir, 0, 0)
    runtime_dir.chmod(0o700)
    os.chown(path, 0, 0, follow_symlinks=False)
    agent, port = attach(processes, job.pid, "--no-inject")
    wait_for(lambda: "dlprof_probe_up" in scrape(port), "the probe's series")
    assert_nothing_of_the_impostor(scrape(port))
    stderr = stop_and_read(agent)
    assert "it is served by uid 65534, not by the job's user" in stderr, stderr


def test_a_socket_served_by_a_process_of_the_same_user_outside_the_job_is_refused(
        processes: list[subprocess.Popen[str]], runtime_dir: Path) -> None:
    job = start_job(processes, runtime_dir)
    plant(processes, runtime_dir / f"probe-{job.pid}.sock", prefix=[])
    runtime_dir.chmod(0o700)
    agent, port = attach(processes, job.pid, "--no-inject")
    wait_for(lambda: "dlprof_probe_up" in scrape(port), "the probe's series")
    assert_nothing_of_the_impostor(scrape(port))
    stderr = stop_and_read(agent)
    assert f"not process {job.pid} or one of its children" in stderr, stderr


def test_the_daemon_refuses_a_planted_socket_too(
        processes: list[subprocess.Popen[str]], runtime_dir: Path) -> None:
    setpriv = needs_root_and_setpriv()
    job = start_job(processes, runtime_dir)
    plant(processes, runtime_dir / f"probe-{job.pid}.sock", prefix=[setpriv, *NOBODY],
          layers=20_001)
    port = free_port()
    daemon = start(processes, [
        sys.executable, "-m", "dlprof_agent", "daemon", "--port", str(port), "--interval",
        "0.25", "--scan-interval", "0.25", "--no-gpu", *OWN_JOBS],
        {**agent_env(), "DLPROF_AGENT_RUNTIME_DIR": str(runtime_dir)})
    wait_for(lambda: f'dlprof_probe_up{{pid="{job.pid}"}}' in scrape(port),
             "the daemon to watch the job")
    exposition = scrape(port)
    assert "123456789" not in exposition and "FAKE-by-nobody" not in exposition
    assert f'dlprof_probe_up{{pid="{job.pid}"}} 0.0' in exposition
    assert len(exposition.splitlines()) < 2_000
    stderr = stop_and_read(daemon)
    assert "its directory belongs to uid 65534" in stderr, stderr


def test_a_reply_carrying_more_than_a_probe_keeps_is_refused_whole(
        processes: list[subprocess.Popen[str]], runtime_dir: Path) -> None:
    """20,001 layers must not become 80,000 series, with --layers or without."""
    job = serve_from_the_job(processes, runtime_dir, 20_001)
    for layers in ((), ("--layers",)):
        agent, port = attach(processes, job.pid, "--no-inject", *layers)
        exposition = scrape(port)
        assert len(exposition.splitlines()) < 2_000, len(exposition.splitlines())
        assert not any(line.startswith("dlprof_layer") for line in exposition.splitlines())
        assert samples(exposition, "dlprof_probe_up") == [0.0]
        stderr = stop_and_read(agent)
        assert "20001 layers, at most" in stderr, stderr


def test_without_layers_a_probe_reply_gives_no_layer_series(
        processes: list[subprocess.Popen[str]], runtime_dir: Path) -> None:
    job = serve_from_the_job(processes, runtime_dir, 5)
    agent, port = attach(processes, job.pid, "--no-inject")
    wait_for(lambda: "dlprof_steps_total" in scrape(port), "the probe's steps")
    assert not any(line.startswith("dlprof_layer") for line in scrape(port).splitlines())
    stop_and_read(agent)
    agent, port = attach(processes, job.pid, "--no-inject", "--layers")
    wait_for(lambda: "dlprof_steps_total" in scrape(port), "the probe's steps")
    assert len(samples(scrape(port), "dlprof_layer_seconds_total")) == 10  # 5 layers, 2 phases
    stop_and_read(agent)


def test_a_probe_in_a_child_of_the_job_is_the_jobs(
        processes: list[subprocess.Popen[str]], runtime_dir: Path) -> None:
    """A launcher (here a shell) whose child runs Python: the child's probe is
    served under the launcher's pid, and is accepted."""
    runtime_dir.mkdir(mode=0o700)
    shell = f'{sys.executable} -c "$0" "{runtime_dir}/probe-$$.sock" 0 no; true'
    job = start(processes, ["sh", "-c", shell, FAKE_PROBE],
                {**agent_env(), "DLPROF_AGENT_RUNTIME_DIR": str(runtime_dir)})
    assert job.stdout is not None and job.stdout.readline().strip() == "serving"
    child = psutil.Process(job.pid).children()[0]  # it prints "serving"
    try:
        agent, port = attach(processes, job.pid, "--no-inject")
        wait_for(lambda: samples(scrape(port), "dlprof_probe_up") == [1.0],
                 "the child's probe")
        stop_and_read(agent)
    finally:
        child.kill()  # the shell's kill at the end would leave it running
