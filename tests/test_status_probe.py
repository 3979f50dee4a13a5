"""What the terminal shows of the probe: the live line and the exit summary."""

from __future__ import annotations

import dataclasses
import io

from dlprof_agent.agent.status import LiveStatus, Summary
from dlprof_agent.model.snapshot import Snapshot
from dlprof_agent.probe_link.samples import LayerSample, ProbeSample
from tests.full_snapshot import full_snapshot


def probe(steady: int, seconds: float, warmup: int = 10) -> ProbeSample:
    return ProbeSample(
        pid=4242, step_source="optimizer", steps=(("steady", steady), ("warmup", warmup)),
        samples=(("steady", 32 * steady), ("warmup", 32 * warmup)),
        step_bucket_bounds=(1.0,), step_bucket_counts=(steady, 0), step_seconds_sum=seconds,
        last_step_seconds=None, phase_seconds=(("forward", seconds / 4),
                                               ("other", 3 * seconds / 4)),
        layers=(LayerSample("fc", seconds / 10, steady, 0.0, 0),
                LayerSample("conv", seconds / 5, steady, seconds / 20, steady)),
        hook_errors=0, dropped_messages=(), settings=())


def test_the_live_line_shows_step_time_and_throughput_over_the_last_interval() -> None:
    out = io.StringIO()
    status = LiveStatus(out)
    status.show(dataclasses.replace(full_snapshot(), probe=probe(0, 0.0, warmup=4)))
    assert out.getvalue().endswith("| steps 4 (warm-up)")
    status.show(dataclasses.replace(full_snapshot(), probe=probe(10, 0.5)))
    status.show(dataclasses.replace(full_snapshot(), probe=probe(30, 1.5)))
    # 20 steps in 1.0 s: 50 ms each, 32 samples each; of that second conv took
    # 0.2 s forward and 0.05 s backward, fc 0.1 s
    assert out.getvalue().endswith("| step 50.0 ms 640 samples/s | top conv 25%, fc 10%")


def test_the_summary_gives_steps_the_split_and_the_top_layers() -> None:
    summary = Summary()
    summary.add(dataclasses.replace(full_snapshot(), probe=probe(100, 2.0)))
    text = summary.render(4242, target_exited=False)
    assert "100 steady (+10 warm-up), mean 20.0 ms, 1600 samples/s" in text
    assert "step split   forward 25%  other 75%" in text
    assert "top layers   conv 25%  fc 10%" in text


def test_the_summary_says_when_there_was_no_probe() -> None:
    summary = Summary()
    summary.add(dataclasses.replace(full_snapshot(), probe=None))
    assert "no in-process probe" in summary.render(4242, target_exited=False)


def at(seconds: float, steady: int, user: float, system: float, involuntary: int) -> Snapshot:
    """The full snapshot's two processes at a moment of a run."""
    snapshot = full_snapshot()
    processes = tuple(dataclasses.replace(process, user_seconds=user / 2,
                                          system_seconds=system / 2,
                                          involuntary_context_switches=involuntary // 2)
                      for process in snapshot.processes)
    return dataclasses.replace(snapshot, monotonic_seconds=seconds, processes=processes,
                               probe=probe(steady, steady * 0.05))


def test_cpu_per_step_is_counted_over_the_steady_steps_only() -> None:
    summary = Summary()
    summary.add(at(0.0, 0, user=5.0, system=1.0, involuntary=10))  # start-up and warm-up
    summary.add(at(1.0, 10, user=6.0, system=1.2, involuntary=20))
    summary.add(at(2.0, 30, user=7.0, system=1.6, involuntary=60))
    summary.add(at(3.0, 30, user=7.1, system=1.6, involuntary=62))  # no step since: left out
    steady = summary.steady_window()
    assert steady is not None
    assert steady["steps"] == 20 and steady["seconds"] == 1.0
    assert abs(steady["step_seconds"] - 0.05) < 1e-12
    assert abs(steady["cpu_user_seconds_per_step"] - 0.05) < 1e-12
    assert abs(steady["cpu_system_seconds_per_step"] - 0.02) < 1e-12
    assert steady["involuntary_switches_per_step"] == 2.0
    whole = summary.as_dict(4242)
    assert whole["steady"] == steady
    assert abs(whole["cpu_user_seconds"] - 2.1) < 1e-12 and whole["involuntary_switches"] == 52
    assert whole["probe"]["steady_steps"] == 30
    assert set(whole["probe"]["layers"]) == {"fc", "conv"}


def test_no_steady_window_before_two_samples_saw_steady_steps() -> None:
    summary = Summary()
    summary.add(at(0.0, 0, user=5.0, system=1.0, involuntary=10))
    summary.add(at(1.0, 10, user=6.0, system=1.2, involuntary=20))
    assert summary.steady_window() is None
    assert summary.as_dict(4242)["steady"] is None
