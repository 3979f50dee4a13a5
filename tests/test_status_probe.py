"""What the terminal shows of the probe: the live line and the exit summary."""

from __future__ import annotations

import dataclasses
import io

from dlprof_agent.agent.status import LiveStatus, Summary
from dlprof_agent.collectors.probe import LayerSample, ProbeSample
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
    # 20 steps in 1.0 s: 50 ms each, 32 samples each
    assert out.getvalue().endswith("| step 50.0 ms 640 samples/s")


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
