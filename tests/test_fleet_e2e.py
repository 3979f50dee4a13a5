"""One data-parallel job on two "nodes", end to end: two torchrun launchers
(--nnodes 2, rendezvous on 127.0.0.1, gloo, one thread per rank), one
`dlprof-agent daemon --no-inject` per node (told apart by GROUP_RANK, each with
its own --node-name; the ranks launched with DLPROF_PROBE=1; without --layers,
as deploy/ starts them: the step split is on by default), and a real Prometheus
evaluating `dlprof-agent rules --rate-window
10s --for 10s`. Rank 1 sleeps in its input before each step, so rank 0 waits for
it in the gradient all-reduce and both report the same step time: only each
rank's own time (step minus exchange) tells them apart.

It holds that both ranks' step series carry one job_id and their own rank; that
the straggler alert fires for rank 1 only, naming input as its cause; and that
stopping one daemon raises the missing-ranks alert. A second job, each rank
pinned to a CPU and rank 1's shared with two busy threads, gets the alert with
cause cpu_starved and no DlprofSlowExchange."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlprof_agent.exporters.prometheus_rules import RANK_OWN_ABOVE_MEDIAN, RANK_STRAGGLER_EXCESS
from tests.conftest import (
    OWN_JOBS,
    REPO,
    Prometheus,
    agent_env,
    free_port,
    running_prometheus,
    wait_for,
)
from tests.test_findings_e2e import BUSY_LOOP, pinned

pytestmark = pytest.mark.slow

JOB_ID = "fleet-e2e"
SLOW_RANK = "1"
INPUT_SLEEP_MS = 25


def firing(prometheus: Prometheus, alertname: str) -> list[dict[str, str]]:
    return [series["metric"] for series in prometheus.query(
        f'ALERTS{{alertstate="firing",alertname=~"{alertname}"}}')]


def rules_config(tmp_path: Path, agent_ports: list[int], rate_window: str = "10s",
                 for_: str = "10s", *options: str) -> Path:
    """Prometheus's config: the agents' scrape and the generated rules (short windows,
    so that the alerts come within the test's minutes)."""
    rules = tmp_path / "rules.yml"
    generated = subprocess.run(
        [sys.executable, "-m", "dlprof_agent", "rules", "--rate-window", rate_window,
         "--for", for_, *options],
        env=agent_env(), capture_output=True, text=True, timeout=60, check=True)
    rules.write_text(generated.stdout)
    targets = ", ".join(f"'127.0.0.1:{port}'" for port in agent_ports)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{rules}']\n"
        "scrape_configs:\n"
        "  - job_name: dlprof\n"
        f"    static_configs: [{{targets: [{targets}]}}]\n")
    return config


def start_node(processes: list[subprocess.Popen[bytes]], tmp_path: Path, node: int,
               master_port: int, *job_args: str) -> None:
    """One node's torchrun launcher, one rank under it, launched with DLPROF_PROBE=1
    and the probe copied as an init container copies it: no rank calls enable(),
    and the daemons never inject."""
    copy = tmp_path / "probe"
    if not copy.exists():
        subprocess.run([sys.executable, "-m", "dlprof_agent", "probe-copy", str(copy)],
                       env=agent_env(), check=True, capture_output=True, timeout=60)
    env = agent_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(copy), env.get("PYTHONPATH")]))
    processes.append(subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
         str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
         str(master_port), "--rdzv-id", JOB_ID, "tests/jobs/torch_ddp.py",
         "--step-log", str(tmp_path / f"steps-{node}"), "--until", str(tmp_path / "stop"),
         *(job_args or ("--slow-rank", SLOW_RANK, "--input-sleep-ms", str(INPUT_SLEEP_MS)))],
        cwd=REPO, env={**env, "DLPROF_PROBE": "1", "OMP_NUM_THREADS": "1"},
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))


def start_daemon(processes: list[subprocess.Popen[bytes]], node: int) -> int:
    port = free_port()
    processes.append(subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "daemon", "--port", str(port), "--quiet",
         "--no-gpu", "--no-inject", "--interval", "0.5", "--scan-interval", "0.5",
         "--env", f"GROUP_RANK={node}", *OWN_JOBS, "--node-name", f"node-{node}"],
        cwd=REPO, env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return port


def stop_launchers(tmp_path: Path, launchers: list[subprocess.Popen[bytes]]) -> None:
    """Both ranks stop after the same step once the stop file is there; a launcher
    still running a minute later is killed with its group."""
    (tmp_path / "stop").touch()
    for process in launchers:
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.serial  # the cause: other tests' load would starve the ranks of CPU
def test_two_nodes_one_job_the_slow_rank_is_named_with_its_cause(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    ports = [start_daemon(processes, node) for node in (0, 1)]
    daemons = list(processes)
    with running_prometheus(rules_config(tmp_path, ports), tmp_path / "data") as prometheus:
        master_port = free_port()
        for node in (0, 1):
            start_node(processes, tmp_path, node, master_port)

        def step_series() -> list[dict[str, str]]:
            return [series["metric"] for series in prometheus.query(
                'dlprof_steps_total{phase="steady"} > 20')]

        try:
            ranks = wait_for(lambda: len(step_series()) == 2 and step_series(),
                             "steady steps from both ranks", 180)
            assert {series["job_id"] for series in ranks} == {JOB_ID}
            assert sorted(series["rank"] for series in ranks) == ["0", "1"]
            info = prometheus.query("dlprof_target_info")
            nodes = {series["metric"]["rank"]: series["metric"]["node"] for series in info
                     if series["metric"].get("role") == "rank"}
            assert nodes == {"0": "node-0", "1": "node-1"}

            fast_rank_fired: list[dict[str, str]] = []
            exchange_fired: list[dict[str, str]] = []

            def straggler() -> list[dict[str, str]]:
                alerts = firing(prometheus, ".*[Ss]traggler.*")
                fast_rank_fired.extend(a for a in alerts if a.get("rank") != SLOW_RANK)
                exchange_fired.extend(firing(prometheus, "DlprofSlowExchange"))
                return alerts

            alerts = wait_for(straggler, "the straggler alert for the slow rank", 180)
            assert {(a["job_id"], a["rank"], a["cause"]) for a in alerts} == {
                (JOB_ID, SLOW_RANK, "input")}
            assert not fast_rank_fired, fast_rank_fired
            assert not exchange_fired, exchange_fired
            # The rank that waits in the all-reduce is not called input-bound.
            verdicts = prometheus.query('dlprof_finding{finding="input_bound"} == 1')
            assert {v["metric"]["rank"] for v in verdicts} <= {SLOW_RANK}, verdicts

            daemons[1].send_signal(signal.SIGTERM)  # node 1's agent goes away
            daemons[1].wait(30)
            missing = wait_for(lambda: firing(prometheus, ".*[Mm]issing.*"),
                               "the missing-ranks alert", 120)
            assert {a["job_id"] for a in missing} == {JOB_ID}
        finally:
            stop_launchers(tmp_path, processes[2:])


STARVING_THREADS = 2
SHORT_STEP_BATCH = 16  # about 12 ms a step here with the rank starved
# The starved rank stands 22-25% of the step above the median here, however starved
# (two to four busy threads, batch 16 to 64: its own side of each all-reduce slows the
# step too), too close to the shipped fifth; this test is of the cause, so its rules
# take the bar a team with quieter ranks would (--straggler-share).
STARVED_TEST_SHARE = "0.1"
WATCH_SECONDS = 30.0  # once the straggler is named: the exchange must not be blamed


@pytest.mark.serial  # the starved rank's CPU must be shared with our busy threads only
def test_a_cpu_starved_rank_of_a_short_step_job_is_named_and_the_exchange_is_not_blamed(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    """Each rank pinned to a CPU of its own, the slow rank's shared with two busy
    threads: its own time per step grows by a few milliseconds of a step of about 12
    (printed), and its main thread waits for its CPU. The straggler alert names it with cause
    cpu_starved; while it holds, DlprofSlowExchange does not fire.
    Everything else the test starts (daemons, Prometheus, launchers) runs on the slow
    rank's CPU too: on two cores, beside the fast rank, it made that rank wait for
    its CPU a third of the time, and the two were not told apart."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: one per rank")
    if not os.path.exists("/proc/self/schedstat"):
        pytest.skip("this kernel keeps no schedstat (CONFIG_SCHED_INFO)")
    slow_cpu = cpus[int(SLOW_RANK) % len(cpus)]
    own_cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {slow_cpu})  # inherited by whatever this thread starts
    try:
        starved_rank_of_a_short_step_job(processes, tmp_path, cpus, slow_cpu)
    finally:
        os.sched_setaffinity(0, own_cpus)


def starved_rank_of_a_short_step_job(processes: list[subprocess.Popen[bytes]],
                                     tmp_path: Path, cpus: list[int], slow_cpu: int) -> None:
    ports = [start_daemon(processes, node) for node in (0, 1)]
    processes += [pinned(slow_cpu, BUSY_LOOP) for _ in range(STARVING_THREADS)]
    config = rules_config(tmp_path, ports, "10s", "10s", "--straggler-share", STARVED_TEST_SHARE)
    with running_prometheus(config, tmp_path / "data") as prometheus:
        master_port = free_port()
        launchers = len(processes)
        for node in (0, 1):
            start_node(processes, tmp_path, node, master_port, "--pin",
                       "--cpus", ",".join(map(str, cpus)), "--batch", str(SHORT_STEP_BATCH))
        try:
            try:
                alerts = wait_for(lambda: firing(prometheus, ".*[Ss]traggler.*"),
                                  "the straggler alert for the starved rank", 240)
            except AssertionError as error:
                raise AssertionError(f"{error}; {what_prometheus_saw(prometheus)}") from None
            assert {(a["job_id"], a["rank"]) for a in alerts} == {(JOB_ID, SLOW_RANK)}
            assert "cpu_starved" in {a["cause"] for a in alerts}, alerts
            # While the straggler holds, the wait is its doing: no slow exchange.
            exchange_fired: list[dict[str, str]] = []
            began = time.monotonic()
            while time.monotonic() - began < WATCH_SECONDS:
                exchange_fired += firing(prometheus, "DlprofSlowExchange")
                time.sleep(1)
            assert not exchange_fired, exchange_fired
            shares = prometheus.query(
                f'{RANK_OWN_ABOVE_MEDIAN}{{rank="{SLOW_RANK}"}} / on (job_id) group_left () '
                f"job_id:dlprof_step_duration_seconds:median")
            print(f"starved rank: own time above the median, of the step, at the end of "
                  f"the watch: {shares and float(shares[0]['value'][1]):.1%}")
        finally:
            stop_launchers(tmp_path, processes[launchers:])


def what_prometheus_saw(prometheus: Prometheus) -> str:
    """Each rank's probe, step rate, run-queue wait and the straggler excess: why
    an alert did not fire, in the failure's message."""
    queries = {
        "probe_up": "dlprof_probe_up",
        "steps/s": "rate(dlprof_steps_total[1m])",
        "run-queue share": "rate(dlprof_process_main_thread_run_queue_wait_seconds_total[1m])"
                           " / rate(dlprof_process_main_thread_run_seconds_total[1m])",
        "excess": RANK_STRAGGLER_EXCESS,
        "pending": "ALERTS",
    }
    seen = []
    for name, query in queries.items():
        try:
            rows = prometheus.query(query)
        except Exception as error:
            seen.append(f"{name}: {error!r:.100}")
            continue
        seen.append(f"{name}: " + ", ".join(
            f"{row['metric'].get('rank', row['metric'].get('alertname', '?'))}="
            f"{row['value'][1]}" for row in rows[:8]))
    return "; ".join(seen)


HEALTHY_SECONDS = 600.0
# Batch 16 spends a fifth of its step in gloo's all-reduce on 2 cores: an exchange
# that is slow indeed. At 64 the step is compute, as a healthy job's is.
HEALTHY_BATCH = 64


@pytest.mark.serial  # a healthy job: other tests' load on one rank would make a straggler
def test_a_healthy_job_stays_silent_for_ten_minutes(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    """Two equal ranks, no slow input, compute-bound, for 10 minutes, under the rules
    as shipped (rate window 1m, for 2m; each rank's last 10 s of steps and 5 s held for
    the straggler): no straggler and no slow exchange fires.
    Prints the largest excess any rank reached over the job's median step time (the
    margin the rule's 20% leaves) and the alerts that were pending."""
    ports = [start_daemon(processes, node) for node in (0, 1)]
    config = rules_config(tmp_path, ports, rate_window="1m", for_="2m")
    with running_prometheus(config, tmp_path / "data") as prometheus:
        master_port = free_port()
        launchers = len(processes)
        for node in (0, 1):
            start_node(processes, tmp_path, node, master_port, "--batch", str(HEALTHY_BATCH),
                       "--max-seconds", str(HEALTHY_SECONDS + 300))
        try:
            wait_for(lambda: len(prometheus.query(
                "job_id_rank:dlprof_step_own_seconds:above_median")) == 2,
                "both ranks' own time", 180)
            began = time.monotonic()
            alerts: list[dict[str, str]] = []
            while time.monotonic() - began < HEALTHY_SECONDS:
                alerts += [series["metric"] for series in prometheus.query(
                    'ALERTS{alertname=~"DlprofStragglerRank|DlprofSlowExchange"}')]
                time.sleep(5)
            print("alerts pending or firing at some point:",
                  sorted({(a["alertname"], a["alertstate"]) for a in alerts}))
            window = f"{HEALTHY_SECONDS:.0f}s"
            worst = prometheus.query(
                "max(max_over_time((job_id_rank:dlprof_step_own_seconds:above_median"
                " / on (job_id) group_left () job_id:dlprof_step_duration_seconds:median)"
                f"[{window}:5s]))")
            print(f"healthy job, {window}: largest rank excess over the median step "
                  f"time {float(worst[0]['value'][1]):.1%}" if worst else "no excess series")
            fired = [alert for alert in alerts if alert["alertstate"] == "firing"]
            assert not fired, fired
        finally:
            stop_launchers(tmp_path, processes[launchers:])
