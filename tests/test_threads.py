"""Per-thread CPU from procfs, and the grouping that keeps group counters monotonic."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from dlprof_agent.collectors.procfs import CLOCK_TICKS_PER_SECOND, ThreadStat, parse_stat
from dlprof_agent.collectors.threads import (
    OTHER_THREAD_GROUP,
    ThreadGrouper,
    ThreadGroupSample,
    read_thread_stats,
)
from dlprof_agent.errors import TargetGone

HZ = CLOCK_TICKS_PER_SECOND


def stat_line(tid: int, comm: str, *, utime: int, stime: int, blkio: int = 0,
              fields: int = 52) -> str:
    """A /proc/<pid>/task/<tid>/stat line with ``fields`` fields, as proc(5) numbers them."""
    values = ["0"] * (fields - 2)  # fields 3..fields
    values[0] = "S"
    values[14 - 3] = str(utime)
    values[15 - 3] = str(stime)
    if fields >= 42:
        values[42 - 3] = str(blkio)
    return f"{tid} ({comm}) {' '.join(values)}\n"


def write_task(procfs: Path, pid: int, tid: int, line: str | None) -> None:
    task = procfs / str(pid) / "task" / str(tid)
    task.mkdir(parents=True)
    if line is not None:
        (task / "stat").write_text(line)


def by_name(groups: tuple[ThreadGroupSample, ...]) -> dict[str, ThreadGroupSample]:
    return {group.name: group for group in groups}


def stat(tid: int, name: str, user: float, system: float = 0.0,
         iowait: float = 0.0) -> ThreadStat:
    return ThreadStat(tid=tid, name=name, user_seconds=user, system_seconds=system,
                      iowait_seconds=iowait)


# --- parsing -----------------------------------------------------------------------


def test_parse_stat_line_keeps_spaces_and_parens_in_the_name() -> None:
    parsed = parse_stat(stat_line(7, "evil) (x y", utime=3, stime=4))
    assert parsed.comm == "evil) (x y"
    assert parsed.state == "S"
    assert parsed.user_seconds == pytest.approx(3 / HZ)
    assert parsed.system_seconds == pytest.approx(4 / HZ)


def test_read_thread_stats_from_a_fake_procfs(tmp_path: Path) -> None:
    pid = 4242
    write_task(tmp_path, pid, 4242, stat_line(4242, "python", utime=250, stime=50, blkio=7))
    write_task(tmp_path, pid, 4243, stat_line(4243, "data loader) 1", utime=3 * HZ,
                                              stime=HZ, blkio=2 * HZ))
    # An old kernel's line that stops before field 42 (delayacct_blkio_ticks).
    write_task(tmp_path, pid, 4244, stat_line(4244, "short", utime=HZ, stime=0, fields=41))
    # A thread that exited between listing task/ and opening its stat file.
    write_task(tmp_path, pid, 4245, None)

    stats = {s.tid: s for s in read_thread_stats(pid, procfs=str(tmp_path))}

    assert set(stats) == {4242, 4243, 4244}
    main = stats[4242]
    assert main.name == "python"
    assert main.user_seconds == pytest.approx(250 / HZ)
    assert main.system_seconds == pytest.approx(50 / HZ)
    assert main.iowait_seconds == pytest.approx(7 / HZ)
    loader = stats[4243]
    assert loader.name == "data loader) 1"
    assert (loader.user_seconds, loader.system_seconds, loader.iowait_seconds) == \
        pytest.approx((3.0, 1.0, 2.0))
    short = stats[4244]
    assert short.name == "short"
    assert short.user_seconds == pytest.approx(1.0)
    assert short.iowait_seconds == 0.0


def test_read_thread_stats_of_a_missing_process_raises(tmp_path: Path) -> None:
    with pytest.raises(TargetGone):
        read_thread_stats(999, procfs=str(tmp_path))


# --- grouping ----------------------------------------------------------------------


def test_threads_sharing_a_name_are_one_group_with_summed_cpu() -> None:
    groups = ThreadGrouper().update([
        stat(1, "python", 5.0, 1.0, 0.5),
        stat(2, "worker", 1.0, 0.25, 0.0),
        stat(3, "worker", 2.0, 0.25, 1.0),
        stat(4, "worker", 3.0, 0.5, 0.0),
    ])
    assert [g.name for g in groups] == ["python", "worker"]
    assert groups[0] == ThreadGroupSample("python", 1, 5.0, 1.0, 0.5)
    assert groups[1] == ThreadGroupSample("worker", 3, 6.0, 1.0, 1.0)


def test_a_group_keeps_the_cpu_of_threads_that_exited() -> None:
    grouper = ThreadGrouper()
    first = by_name(grouper.update([stat(1, "main", 1.0), stat(2, "w", 2.0), stat(3, "w", 4.0)]))
    assert first["w"].user_seconds == 6.0
    assert first["w"].threads == 2

    second = by_name(grouper.update([stat(1, "main", 1.5), stat(2, "w", 3.0)]))
    assert second["w"].threads == 1
    assert second["w"].user_seconds == 7.0  # 3.0 live + 4.0 from the thread that left

    third = by_name(grouper.update([stat(1, "main", 2.0)]))
    assert third["w"].threads == 0
    assert third["w"].user_seconds == 7.0  # the group stays, its counter does not drop
    assert third["main"].user_seconds == 2.0


def test_a_renamed_thread_counts_to_its_new_group_from_the_rename_on() -> None:
    grouper = ThreadGrouper()
    grouper.update([stat(5, "python", 3.0, 1.0)])

    renamed = by_name(grouper.update([stat(5, "loader", 4.0, 1.5)]))
    assert renamed["python"] == ThreadGroupSample("python", 0, 3.0, 1.0, 0.0)
    assert renamed["loader"] == ThreadGroupSample("loader", 1, 1.0, 0.5, 0.0)

    later = by_name(grouper.update([stat(5, "loader", 6.0, 2.0)]))
    assert later["python"].user_seconds == 3.0
    assert later["loader"].user_seconds == 3.0

    back = by_name(grouper.update([stat(5, "python", 7.0, 2.0)]))
    assert back["python"] == ThreadGroupSample("python", 1, 4.0, 1.0, 0.0)
    assert back["loader"] == ThreadGroupSample("loader", 0, 3.0, 1.0, 0.0)
    assert sum(g.user_seconds for g in back.values()) == pytest.approx(7.0)
    assert sum(g.system_seconds for g in back.values()) == pytest.approx(2.0)


@dataclass
class _Thread:
    tid: int
    name: str
    user: float = 0.0


def test_groups_add_up_to_the_true_total_and_never_drop_under_churn() -> None:
    """Random births, exits, renames and CPU use, against a plain running total."""
    rng = random.Random(20240611)
    grouper = ThreadGrouper(max_groups=4)
    names = ["main", "w", "loader", "pin", "nccl", "misc"]
    live: dict[int, _Thread] = {}
    used_by_exited = 0.0
    next_tid = 100
    previous: dict[str, float] = {}
    for _ in range(300):
        action = rng.random()
        if action < 0.2 or not live:
            live[next_tid] = _Thread(next_tid, rng.choice(names))
            next_tid += 1
        elif action < 0.35:
            gone = live.pop(rng.choice(sorted(live)))
            used_by_exited += gone.user
        elif action < 0.5:
            live[rng.choice(sorted(live))].name = rng.choice(names)
        # CPU used by a thread after its last sample and before it exits is
        # invisible to any reader, so exits above come before this interval's use.
        for thread in live.values():
            thread.user += rng.choice([0.0, 0.01, 0.5, 1.0])

        groups = grouper.update([stat(t.tid, t.name, t.user) for t in live.values()])

        true_total = used_by_exited + sum(t.user for t in live.values())
        assert sum(g.user_seconds for g in groups) == pytest.approx(true_total)
        assert sum(g.threads for g in groups) == len(live)
        now = {g.name: g.user_seconds for g in groups}
        for name, seconds in previous.items():
            assert now[name] >= seconds - 1e-9, f"group {name} went backwards"
        previous = now
        assert len(groups) <= 4 + 1  # the cap, plus "other"


def test_names_past_the_cap_go_to_other() -> None:
    grouper = ThreadGrouper(max_groups=2)
    groups = by_name(grouper.update([
        stat(1, "a", 1.0), stat(2, "b", 2.0), stat(3, "c", 3.0), stat(4, "d", 4.0),
        stat(5, "a", 0.5),
    ]))
    assert set(groups) == {"a", "b", OTHER_THREAD_GROUP}
    assert groups["a"].threads == 2
    assert groups["a"].user_seconds == 1.5
    assert groups[OTHER_THREAD_GROUP].threads == 2
    assert groups[OTHER_THREAD_GROUP].user_seconds == 7.0

    # A name seen before the cap keeps its group; new names still go to "other".
    later = by_name(grouper.update([stat(1, "a", 2.0), stat(6, "e", 1.0), stat(7, "b", 1.0)]))
    assert set(later) == {"a", "b", OTHER_THREAD_GROUP}
    assert later["b"].threads == 1
    assert later["b"].user_seconds == 3.0  # 2.0 from tid 2 (exited) + 1.0 from tid 7
    assert later[OTHER_THREAD_GROUP].threads == 1
    assert later[OTHER_THREAD_GROUP].user_seconds == 8.0  # 3 + 4 retired, 1 live


def test_a_reused_tid_does_not_make_the_group_counter_drop() -> None:
    grouper = ThreadGrouper()
    grouper.update([stat(7, "w", 5.0)])
    # Thread 7 exited and, before the next sample, a new thread "w" got tid 7
    # (pid_max is 32768 on many hosts; loaders start and stop threads often).
    groups = by_name(grouper.update([stat(7, "w", 0.1)]))
    assert groups["w"].user_seconds == pytest.approx(5.1)
    assert groups["w"].threads == 1
