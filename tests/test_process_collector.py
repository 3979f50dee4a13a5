"""ProcessCollector against real processes the tests start, checked against /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import psutil
import pytest

import dlprof_agent
from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.process import ProcessCollector, ProcessSample, _PeakTracker
from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import TargetGone
from tests.helpers import wait_until

CLK_TCK = os.sysconf("SC_CLK_TCK")
MIB = 1 << 20
# The folder that holds the dlprof_agent package, for the workload's PYTHONPATH.
PACKAGE_PARENT = str(Path(dlprof_agent.__file__).resolve().parent.parent)

class Spawn(Protocol):
    def __call__(self, args: list[str], *, stdin: int | None = None,
                 stdout: int | None = None) -> subprocess.Popen[str]: ...


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Starts processes in their own session; kills each whole group afterwards."""
    started: list[subprocess.Popen[str]] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))}

    def start(args: list[str], *, stdin: int | None = None,
              stdout: int | None = None) -> subprocess.Popen[str]:
        process = subprocess.Popen(args, env=env, text=True, start_new_session=True,
                                   stdin=stdin, stdout=stdout)
        started.append(process)
        return process

    yield start
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the workload's children too
        process.wait(10)
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()


def busy(spawn: Spawn, *, threads: int = 2, children: int = 0) -> subprocess.Popen[str]:
    process = spawn([sys.executable, "-m", "dlprof_agent.workloads.busy",
                     "--threads", str(threads), "--children", str(children),
                     "--duty", "0.5", "--seconds", "60"], stdout=subprocess.PIPE)
    assert process.stdout is not None
    assert process.stdout.readline().startswith("busy: pid"), "the workload did not start"
    return process


def stopped(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread is stopped, so /proc holds still."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, 10, what="SIGSTOP")


def target_of(samples: tuple[ProcessSample, ...]) -> ProcessSample:
    targets = [s for s in samples if s.is_target]
    assert len(targets) == 1
    return targets[0]


def stat_ticks(pid: int) -> tuple[int, int]:
    """utime and stime (fields 14 and 15 of proc(5)) in clock ticks."""
    with open(f"/proc/{pid}/stat") as stat:
        after_comm = stat.read().rsplit(")", 1)[1].split()
    return int(after_comm[14 - 3]), int(after_comm[15 - 3])


def test_pid_threads_and_cpu_match_procfs(spawn: Spawn) -> None:
    process = busy(spawn, threads=2)
    wait_until(lambda: stat_ticks(process.pid)[0] >= 0.3 * CLK_TCK, 10, what="0.3 s of CPU use")
    stopped(process.pid)
    errors = ErrorLog()

    sample = target_of(ProcessCollector(Target.of(process.pid),
                                        children=False, errors=errors).sample())

    utime, stime = stat_ticks(process.pid)
    assert sample.pid == process.pid
    assert sample.ppid == os.getpid()
    assert sample.threads == len(os.listdir(f"/proc/{process.pid}/task"))
    assert sample.threads >= 3  # main thread + 2 workers
    assert sample.user_seconds == pytest.approx(utime / CLK_TCK, rel=0.02)
    assert sample.system_seconds == pytest.approx(stime / CLK_TCK, rel=0.02, abs=2 / CLK_TCK)
    assert sample.rss_bytes > 0
    assert sample.vms_bytes >= sample.rss_bytes
    assert sample.open_fds is not None and sample.open_fds >= 3
    assert sample.read_chars is not None  # our own child: /proc/<pid>/io is readable
    # The thread groups cover every live thread and, between them, the process's CPU.
    assert sum(g.threads for g in sample.thread_groups) == sample.threads
    assert sum(g.user_seconds for g in sample.thread_groups) == pytest.approx(
        sample.user_seconds, rel=0.05, abs=3 / CLK_TCK)
    assert errors.counts() == {}


def test_thread_groups_show_the_named_worker_threads(spawn: Spawn) -> None:
    process = busy(spawn, threads=2)
    collector = ProcessCollector(Target.of(process.pid), children=False, errors=ErrorLog())

    def named_workers() -> bool:
        names = {g.name: g for g in target_of(collector.sample()).thread_groups}
        return {"busy-0", "busy-1"} <= set(names)

    wait_until(named_workers, 10,
               what="threads named busy-0 and busy-1 (busy.py names them via prctl)")
    groups = {g.name: g for g in target_of(collector.sample()).thread_groups}
    assert groups["busy-0"].threads == 1
    assert groups["busy-1"].threads == 1
    wait_until(lambda: all(
        g.user_seconds > 0 for g in target_of(collector.sample()).thread_groups
        if g.name.startswith("busy-")), 10, what="the workers to use CPU")


def test_children_are_reported_under_their_own_pid_only_when_asked(spawn: Spawn) -> None:
    process = busy(spawn, threads=1, children=1)
    with_children = ProcessCollector(Target.of(process.pid), children=True, errors=ErrorLog())
    without = ProcessCollector(Target.of(process.pid), children=False, errors=ErrorLog())

    def worker_children() -> list[ProcessSample]:
        return [s for s in with_children.sample() if s.name == "busy-child"]

    wait_until(lambda: len(worker_children()) == 1, 10, what="the busy-child process")
    child = worker_children()[0]
    expected_child_pids = {c.pid for c in psutil.Process(process.pid).children()
                           if c.name() == "busy-child"}
    assert child.pid in expected_child_pids
    assert child.pid != process.pid
    assert not child.is_target
    assert child.ppid == process.pid
    assert "busy-child" in {g.name for g in child.thread_groups}

    alone = without.sample()
    assert [s.pid for s in alone] == [process.pid]
    assert alone[0].is_target


PEAK_SCRIPT = textwrap.dedent("""
    import sys
    spike = b"\\x01" * (200 << 20)  # before attach: must not count as the peak since
    del spike
    print("ready", flush=True)
    sys.stdin.readline()
    spike = b"\\x01" * (300 << 20)  # after attach, freed before the next sample
    del spike
    print("freed", flush=True)
    sys.stdin.readline()
""")


def test_peak_rss_counts_spikes_between_samples_but_not_before_attach(spawn: Spawn) -> None:
    process = spawn([sys.executable, "-c", PEAK_SCRIPT],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert process.stdin is not None and process.stdout is not None
    assert process.stdout.readline() == "ready\n"
    collector = ProcessCollector(Target.of(process.pid), children=False, errors=ErrorLog())

    before = target_of(collector.sample())
    assert before.rss_bytes < 150 * MIB
    assert before.rss_bytes <= before.rss_peak_bytes < 150 * MIB  # the 200 MiB was earlier

    process.stdin.write("go\n")
    process.stdin.flush()
    assert process.stdout.readline() == "freed\n"

    after = target_of(collector.sample())
    assert after.rss_bytes < 150 * MIB  # the memory is back with the kernel...
    assert after.rss_peak_bytes >= 300 * MIB  # ...but the spike is in the kernel's VmHWM
    assert after.rss_peak_bytes >= after.rss_bytes
    assert target_of(collector.sample()).rss_peak_bytes >= after.rss_peak_bytes


def test_peak_tracker_uses_the_high_water_mark_only_once_it_rises_after_attach() -> None:
    tracker = _PeakTracker(hwm_at_attach=500)
    assert tracker.update(rss_bytes=100, hwm_bytes=500) == 100  # 500 was before attach
    assert tracker.update(rss_bytes=120, hwm_bytes=None) == 120
    assert tracker.update(rss_bytes=110, hwm_bytes=800) == 800  # a spike since attach
    assert tracker.update(rss_bytes=90, hwm_bytes=800) == 800  # peaks never drop
    assert tracker.update(rss_bytes=900, hwm_bytes=800) == 900

    blind = _PeakTracker(hwm_at_attach=None)  # VmHWM unreadable at attach: RSS only
    assert blind.update(rss_bytes=100, hwm_bytes=10**9) == 100


def test_target_gone_once_the_process_exits_and_is_reaped(spawn: Spawn) -> None:
    process = spawn(["sleep", "30"])
    collector = ProcessCollector(Target.of(process.pid), errors=ErrorLog())
    assert target_of(collector.sample()).name == "sleep"

    process.kill()
    process.wait(5)
    with pytest.raises(TargetGone) as gone:
        collector.sample()
    assert gone.value.pid == process.pid


def test_target_gone_while_the_process_is_a_zombie(spawn: Spawn) -> None:
    process = spawn(["sleep", "30"])
    collector = ProcessCollector(Target.of(process.pid), errors=ErrorLog())
    collector.sample()

    os.kill(process.pid, signal.SIGKILL)  # not reaped: it stays a zombie
    wait_until(lambda: psutil.Process(process.pid).status() == psutil.STATUS_ZOMBIE, 10,
               what="zombie")
    with pytest.raises(TargetGone):
        collector.sample()


def test_no_such_process_fails_at_construction_in_our_own_terms() -> None:
    pid = 4_194_000  # above every default pid_max
    assert not os.path.exists(f"/proc/{pid}")
    with pytest.raises(TargetGone) as raised:
        ProcessCollector(Target.of(pid), errors=ErrorLog())
    assert raised.value.pid == pid and not isinstance(raised.value, psutil.Error)


def test_target_exiting_between_checks_is_target_gone_not_an_error(tmp_path: Path) -> None:
    # A procfs tree whose process is there when the collector starts and gone at
    # its next read: its folder removed, as the kernel removes an exited one's.
    process = tmp_path / "4242"
    process.mkdir()
    (process / "status").write_text("Name:\tsleep\nVmHWM:\t1024 kB\n")
    (process / "stat").write_text("4242 (sleep) S 1 4242 4242 0 -1 0 0 0 0 0 1 2 0 0 20 0 1 0 "
                                  "777 1000 10 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n")
    (tmp_path / "stat").write_text("cpu 1 2 3 4\nbtime 1700000000\n")
    collector = ProcessCollector(Target.of(4242, procfs=str(tmp_path)), errors=ErrorLog())
    for name in ("stat", "status"):
        (process / name).unlink()
    process.rmdir()
    with pytest.raises(TargetGone):
        collector.sample()
