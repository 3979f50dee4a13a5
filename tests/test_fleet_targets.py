"""Which processes of a multi-process job are targets, and who each says it is:
a launcher's ranks are targets of their own (RANK, SLURM_PROCID or TF_CONFIG in
their environment), its other children and a rank's own workers stay with their
parent; --node-name's default; and, end to end, a real rank's series carry its
job_id and rank on the daemon's endpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from dlprof_agent.agent.core import Agent
from dlprof_agent.agent.discovery import DaemonOptions, Discovery
from dlprof_agent.cli.options import resolved_node_name
from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.host import HostCollector
from dlprof_agent.collectors.identity import ROLE_LAUNCHER, ROLE_RANK
from tests.conftest import OWN_JOBS, REPO, agent_env, free_port, http_get, wait_for

SLEEP = "import time; time.sleep(600)"
# A launcher as torchrun is one: no rank of its own; a rank child (which starts a
# worker that inherits its environment, as a data loader's does) and a plain child.
LAUNCHER = f"""
import os, subprocess, sys
rank_env = {{**os.environ, "RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "fleet-1"}}
rank = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=rank_env)
plain = subprocess.Popen([sys.executable, "-c", {SLEEP!r}])
print("rank", rank.pid, flush=True)
print("plain", plain.pid, flush=True)
import time; time.sleep(600)
"""
RANK = f"""
import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", {SLEEP!r}])
print("worker", worker.pid, flush=True)
{SLEEP}
"""


@pytest.fixture
def launcher() -> Iterator[tuple[str, dict[str, int]]]:
    """A launcher (found by a marker on its command line) and its tree's pids."""
    marker = f"fleet-launcher-{uuid.uuid4().hex[:8]}"
    process = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, marker],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert process.stdout is not None
        pids = {"launcher": process.pid}
        for _ in range(3):
            role, pid = process.stdout.readline().split()
            pids[role] = int(pid)
        yield marker, pids
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the whole tree: it leads its session
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def test_a_launchers_ranks_are_targets_of_their_own(
        launcher: tuple[str, dict[str, int]]) -> None:
    marker, pids = launcher
    options = DaemonOptions(matches=(re.compile(re.escape(marker)),), gpu=False,
                            node_name="node-a")
    daemon = Agent(options, chooser=Discovery(options, socket_dirs=()),
                   host=HostCollector(), gpu=None, errors=ErrorLog())
    try:
        node = daemon.sample_once()
        assert set(daemon.targets) == {pids["launcher"], pids["rank"]}
        by_pid = {snapshot.target_pid: snapshot for snapshot in node.targets}
        launched, rank = by_pid[pids["launcher"]], by_pid[pids["rank"]]
        assert launched.identity is not None and rank.identity is not None
        assert launched.identity.role == ROLE_LAUNCHER
        assert (rank.identity.role, rank.identity.rank, rank.identity.job_id,
                rank.identity.world_size) == (ROLE_RANK, "1", "fleet-1", 2)
        assert rank.identity.node == "node-a"
        # Each process is read once: the rank and its worker under the rank, the
        # plain child under the launcher.
        assert {p.pid for p in launched.processes} == {pids["launcher"], pids["plain"]}
        assert {p.pid for p in rank.processes} == {pids["rank"], pids["worker"]}
        daemon.scan()  # and a second look takes no worker for a rank
        assert set(daemon.targets) == {pids["launcher"], pids["rank"]}
    finally:
        daemon.close()


def test_the_node_name_comes_from_the_option_then_node_name_then_slurm_then_the_host(
        ) -> None:
    both = {"NODE_NAME": "k8s-node", "SLURMD_NODENAME": "gpu-07"}
    assert resolved_node_name("given", both) == "given"
    assert resolved_node_name(None, both) == "k8s-node"
    assert resolved_node_name(None, {"SLURMD_NODENAME": "gpu-07", "NODE_NAME": " "}) == "gpu-07"
    assert resolved_node_name(None, {}) == os.uname().nodename


def test_the_help_teaches_the_node_name_and_the_ranks() -> None:
    for command in ("attach", "daemon"):
        result = subprocess.run([sys.executable, "-m", "dlprof_agent", command, "--help"],
                                capture_output=True, text=True, env=agent_env(), cwd=REPO,
                                timeout=60, check=True)
        text = " ".join(result.stdout.split())
        assert "--node-name NAME" in text and "$NODE_NAME" in text
        assert "$SLURMD_NODENAME" in text
    assert "RANK, SLURM_PROCID or TF_CONFIG" in text  # the daemon's


STEPPING_RANK = """
import time
import dlprof_agent.probe
dlprof_agent.probe.enable()
while True:
    dlprof_agent.probe.step(samples=8)
    time.sleep(0.02)
"""


@pytest.mark.slow  # starts a daemon and a job with the probe
def test_a_real_ranks_steps_carry_its_job_id_and_rank_on_the_daemons_endpoint(
        tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {**agent_env(), "DLPROF_AGENT_RUNTIME_DIR": str(runtime)}
    rank_env = {**env, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "GROUP_RANK": "1",
                "TORCHELASTIC_RUN_ID": "fleet-e2e"}
    rank = subprocess.Popen([sys.executable, "-c", STEPPING_RANK], env=rank_env, cwd=REPO)
    port = free_port()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "daemon", "--port", str(port), "--interval",
         "0.25", "--scan-interval", "0.25", "--no-gpu", "--warmup-steps", "2",
         "--node-name", "node-b", *OWN_JOBS], cwd=REPO, env=env, stderr=subprocess.PIPE,
        text=True)
    try:
        def rank_samples(name: str) -> list[Sample]:
            text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
            return [sample for family in text_string_to_metric_families(text)
                    for sample in family.samples
                    if sample.name == name and sample.labels.get("pid") == str(rank.pid)]

        steady = wait_for(lambda: [s for s in rank_samples("dlprof_steps_total")
                                   if s.labels["phase"] == "steady" and s.value > 0],
                          "the rank's steady steps", 60)
        assert [(s.labels["job_id"], s.labels["rank"]) for s in steady] == [("fleet-e2e", "1")]
        (info,) = rank_samples("dlprof_target_info")
        assert info.value == 1
        assert {key: info.labels[key] for key in (
            "job_id", "rank", "local_rank", "node_rank", "world_size", "node", "role")} == {
            "job_id": "fleet-e2e", "rank": "1", "local_rank": "0", "node_rank": "1",
            "world_size": "2", "node": "node-b", "role": "rank"}
        (world,) = rank_samples("dlprof_target_world_size")
        assert (world.labels, world.value) == (
            {"pid": str(rank.pid), "job_id": "fleet-e2e", "rank": "1"}, 2)
        # The process families stay keyed by pid alone.
        (threads,) = rank_samples("dlprof_process_threads")
        assert threads.labels == {"pid": str(rank.pid)}
    finally:
        rank.kill()
        rank.wait(10)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(15)
        assert daemon.stderr is not None
        log_lines = daemon.stderr.read()
        daemon.stderr.close()
    assert "Traceback" not in log_lines
