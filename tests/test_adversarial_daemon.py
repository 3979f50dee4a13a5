"""Attacks on the agent's loop and its stop, as an adversary would try them:

- drip: a process of its own serves the probe protocol, then answers
  `snapshot` with a valid header and the rest one byte every 0.3 s, beside a
  real small job with the probe; a real `daemon` (`--match` both) and a real
  Prometheus. The job's steps keep arriving, /healthz stays 200, the drip is
  counted and listed, and the daemon exits after SIGTERM;
- signals: SIGTERM at random instants of `attach`'s start on a small real job
  (injection included): every exit with one line, and nothing of
  the agent left in the job (no probe thread, no probe socket); and SIGTERM
  just after a flood of wrong passwords, while a password check runs: an exit
  with its line, never an abort.

Each exit's time after SIGTERM is printed: a few tenths of a second on an idle machine.
On cores the tests keep busy the agent may wait its turn for seconds; only an agent
still there after ``STOP_SECONDS`` fails (a hang).

The figures each test measures are printed (`pytest -s`) for docs/security.md."""

from __future__ import annotations

import base64
import functools
import itertools
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from dlprof_agent.collectors.procfs import read_task_stats
from dlprof_agent.errors import TargetGone
from dlprof_agent.probe.protocol import socket_name
from dlprof_agent.probe_link.client import held_sockets
from tests.conftest import PROMETHEUS, agent_env, free_port, wait_for
from tests.helpers import SCRAPE_TIMEOUT_SECONDS
from tests.test_adversarial_tenancy import (
    runtime_dir,  # noqa: F401  (a fixture)
    sample,
    scrape,
    start,
    start_daemon,
    start_prometheus,
)

pytestmark = pytest.mark.slow
# Of this worker: another worker's jobs of this file must not become this daemon's targets.
MARKER = f"dlprof-adversarial-daemon-{os.getpid()}"
STOP_SECONDS = 60.0  # an agent not gone this long after SIGTERM hangs

# A tenant's process serving the probe protocol at its own pid's socket, whose
# snapshot replies drip: a valid header, then one byte every 0.3 s.
DRIP = textwrap.dedent("""
    import os, socket, sys, threading, time
    from dlprof_agent.probe.protocol import HEADER, encode, read_frame
    path = os.path.join(sys.argv[1], f"probe-{os.getpid()}.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(8)
    hello = encode({"ok": True, "version": 1, "pid": os.getpid(), "frameworks": ["torch"]})
    snapshot = encode({"ok": True, "probe": {"padding": "x" * 4096}})
    print("serving", flush=True)
    def serve(connection):
        with connection:
            while True:
                try:
                    command = read_frame(connection, max_bytes=1 << 16)["command"]
                    if command != "snapshot":
                        connection.sendall(hello)
                        continue
                    connection.sendall(snapshot[:HEADER.size])
                    for byte in snapshot[HEADER.size:]:
                        time.sleep(0.3)
                        connection.sendall(bytes([byte]))
                except Exception:
                    return
    while True:
        threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
""")

# A small real job: the probe enabled, a step every 50 ms.
JOB = textwrap.dedent("""
    import sys, time
    from dlprof_agent import probe
    if sys.argv[1] == "probe":
        probe.enable()
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
        if sys.argv[1] == "probe":
            probe.step(samples=1)
""")


def status_of(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_SECONDS) as response:
            return response.status, bytes(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def stop_within(process: subprocess.Popen[Any], seconds: float) -> float:
    """Seconds from SIGTERM to ``process``'s exit; fails past ``seconds``."""
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"no exit {seconds:g} s after SIGTERM")
    return time.monotonic() - sent


def test_drip_never_delays_the_other_job_nor_the_daemons_loop(
        processes: list[subprocess.Popen[str]], runtime_dir: Path,  # noqa: F811
        tmp_path: Path) -> None:
    env = {**agent_env(), "DLPROF_AGENT_RUNTIME_DIR": str(runtime_dir)}
    drip = start(processes, [sys.executable, "-c", DRIP, str(runtime_dir), MARKER], env)
    # Its job_id and rank fixed, so that its step series has known labels.
    job = start(processes, [sys.executable, "-c", JOB, "probe", MARKER],
                {**env, "DLPROF_JOB_ID": "drip-test", "RANK": "0"})
    for process, ready in ((drip, "serving"), (job, "ready")):
        assert process.stdout is not None and process.stdout.readline().strip() == ready
    daemon, port = start_daemon(processes, runtime_dir, "--match", MARKER)
    prometheus = start_prometheus(processes, tmp_path, port) if PROMETHEUS else None
    steady = (f'dlprof_steps_total{{job_id="drip-test",phase="steady",pid="{job.pid}",'
              'rank="0"}')
    wait_for(lambda: (sample(scrape(port), steady) or 0) > 0, "the job's steps")
    wait_for(lambda: (sample(scrape(port), "dlprof_probe_deadline_misses_total"
                             f'{{pid="{drip.pid}"}}') or 0) > 0, "the drip's first miss")
    # 15 s of the drip: every pass the daemon makes brings the job's new steps.
    steps_by_pass: dict[float, float] = {}
    unhealthy, listed = [], set()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        code, body = status_of(f"http://127.0.0.1:{port}/healthz")
        if code != 200:
            unhealthy.append(code)
        probes = json.loads(body).get("probes", {})
        listed |= {state for state, pids in probes.items() if str(drip.pid) in pids}
        exposition = scrape(port)
        passes, steps = sample(exposition, "dlprof_agent_samples_total"), sample(exposition,
                                                                                steady)
        assert passes is not None and steps is not None, "a scrape was cut off"
        steps_by_pass.setdefault(passes, steps)
        time.sleep(0.25)
    ordered = [steps_by_pass[key] for key in sorted(steps_by_pass)]
    missed = sum(1 for before, after in itertools.pairwise(ordered) if after <= before)
    misses = sample(scrape(port), f'dlprof_probe_deadline_misses_total{{pid="{drip.pid}"}}')
    assert not unhealthy, f"/healthz answered {unhealthy}"
    assert len(ordered) >= 5, f"only {len(ordered)} passes in 15 s"
    assert missed <= 1, f"{missed} passes brought none of the job's steps: {ordered}"
    assert misses is not None and misses > 0
    assert listed, "the status page never listed the drip"
    if prometheus is not None:
        wait_for(lambda: prometheus.query(f'{steady} > 0'), "Prometheus to see the job's steps")
        wait_for(lambda: prometheus.query(
            f'dlprof_probe_deadline_misses_total{{pid="{drip.pid}"}} > 0'),
            "Prometheus to see the drip's misses")
        assert prometheus.value(f'up{{instance="127.0.0.1:{port}"}}') == 1
    took = stop_within(daemon, STOP_SECONDS)
    _, stderr = daemon.communicate(timeout=10)
    print(f"\ndrip: {len(ordered)} passes in 15 s, {missed} without the job's new steps, "
          f"/healthz 200 throughout, drip listed as {sorted(listed)}, {misses:.0f} misses "
          f"counted; exit {took:.2f} s after SIGTERM (code {daemon.returncode})")
    assert daemon.returncode == 0
    assert stderr.strip().splitlines()[-1] == "dlprof-agent: stopped by SIGTERM"


def ours_in(pid: int) -> list[str]:
    """What of the agent is in process ``pid``: the probe's thread, its socket."""
    try:
        threads = [f"thread {t.name}" for t in read_task_stats(pid) if t.name == "dlprof-probe"]
    except TargetGone:
        return []
    return threads + [f"socket {path}" for path in held_sockets(pid, {socket_name(pid)})]


def catches_sigterm(pid: int) -> bool:
    """Whether ``pid`` has its SIGTERM handler in place (SigCgt in its status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def test_sigterm_at_any_instant_of_attachs_start_leaves_nothing_behind(
        processes: list[subprocess.Popen[str]]) -> None:
    job = start(processes, [sys.executable, "-c", JOB, "plain", MARKER])
    assert job.stdout is not None and job.stdout.readline().strip() == "ready"
    pick = random.Random(26)
    exits, codes, lines = [], set(), set()
    for _ in range(20):
        attach = start(processes, [sys.executable, "-m", "dlprof_agent", "attach",
                                   str(job.pid), "--port", "0", "--no-gpu",
                                   "--interval", "0.5"])
        # From the moment the agent handles SIGTERM (before, the default action ends
        # it, and it has touched nothing): start-up, injection and the first passes.
        wait_for(functools.partial(catches_sigterm, attach.pid), "attach to handle SIGTERM", 30)
        time.sleep(pick.uniform(0.0, 1.5))
        exits.append(stop_within(attach, STOP_SECONDS))
        _, stderr = attach.communicate(timeout=10)
        codes.add(attach.returncode)
        lines.add(stderr.strip().splitlines()[-1] if stderr.strip() else "")
        # The probe leaves with its agent, within one of its intervals, and none
        # comes up later (an injection the stop cut short): nothing 3 s after.
        exited = time.monotonic()
        try:
            wait_for(lambda: not ours_in(job.pid), "the probe to leave the job", timeout=3)
            while time.monotonic() < exited + 3:
                assert not ours_in(job.pid)
                time.sleep(0.1)
        except AssertionError:
            pytest.fail(f"left in the job after attach's exit: {ours_in(job.pid)} (threads "
                        f"{[t.name for t in read_task_stats(job.pid)]}; attach said {stderr!r})")
    print(f"\nsignals: 20 SIGTERMs during attach's start: exits {min(exits):.2f}-"
          f"{max(exits):.2f} s after, codes {sorted(codes)}, nothing left in the job")
    assert codes == {0}, (codes, lines)
    assert lines == {"dlprof-agent: stopped by SIGTERM"}, lines


def test_sigterm_just_after_an_auth_flood_exits_with_its_line_never_an_abort(
        processes: list[subprocess.Popen[Any]], tmp_path: Path) -> None:
    bcrypt = pytest.importorskip("bcrypt", reason="bcrypt is not installed: "
                                 "pip install 'dlprof-agent[web]'")
    password = "the scraper's password"
    config = tmp_path / "web-config.yml"
    config.write_text("basic_auth_users:\n  prometheus: "
                      f"'{bcrypt.hashpw(password.encode(), bcrypt.gensalt(10)).decode()}'\n")
    job = start(processes, [sys.executable, "-c", JOB, "plain", MARKER])
    assert job.stdout is not None and job.stdout.readline().strip() == "ready"
    port = free_port()
    attach = start(processes, [sys.executable, "-m", "dlprof_agent", "attach", str(job.pid),
                               "--port", str(port), "--quiet", "--no-probe", "--interval", "0.5",
                               "--web.config.file", str(config)])

    def scrape_with_password() -> bool:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={
            "Authorization": "Basic " + base64.b64encode(
                f"prometheus:{password}".encode()).decode()})
        with urllib.request.urlopen(request, timeout=SCRAPE_TIMEOUT_SECONDS) as response:
            return bool(response.status == 200)

    wait_for(scrape_with_password, "a first scrape with the password")
    # Two seconds of new wrong passwords from clients that stay: the checking
    # thread is inside bcrypt when SIGTERM comes.
    clients, end = [], time.monotonic() + 2
    try:
        while time.monotonic() < end:
            try:
                client = socket.create_connection(("127.0.0.1", port), timeout=1)
                client.sendall(("GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic "
                                + base64.b64encode(f"prometheus:{secrets.token_hex(8)}".encode()
                                                   ).decode() + "\r\n\r\n").encode())
                clients.append(client)
            except OSError:
                pass
            time.sleep(0.005)
        took = stop_within(attach, STOP_SECONDS)
    finally:
        for client in clients:
            client.close()
    _, stderr = attach.communicate(timeout=10)
    print(f"\nauth flood then SIGTERM: {len(clients)} wrong passwords in 2 s, exit {took:.2f} s "
          f"after SIGTERM, code {attach.returncode}")
    assert "FATAL" not in stderr, stderr
    assert attach.returncode == 0, stderr
    assert stderr.strip().splitlines()[-1] == "dlprof-agent: stopped by SIGTERM"
