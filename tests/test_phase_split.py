"""The recorder's step split on its own clock, and how it reaches the
exporter and the summary: phases that nest count once, in the innermost;
each step is split when it ends; a split that cannot be made says why."""

from __future__ import annotations

import dataclasses

import pytest

from dlprof_agent.agent.status import Summary
from dlprof_agent.exporters.probe_families import probe_families
from dlprof_agent.probe.recorder import COMPILED_GRAPH, LayerSampling, Recorder
from dlprof_agent.probe_link.samples import ProbeSample
from tests.full_snapshot import full_snapshot


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def recorder_on_a_clock(sampling: LayerSampling | None = None) -> tuple[Recorder, Clock]:
    clock = Clock()
    recorder = Recorder(warmup_steps=0, clock=clock, layer_sampling=sampling)
    recorder.step_boundary("optimizer")
    return recorder, clock


def closure_step(recorder: Recorder, clock: Clock) -> None:
    """optimizer.step(closure): forward 0.3 s and backward 0.4 s inside the
    closure (0.8 s), inside the optimizer's step (1.0 s); 0.5 s before it."""
    clock.now += 0.5
    optimizer = recorder.phase_mark()
    closure = recorder.phase_mark()
    recorder.add_phase_time("forward", 0.3)
    recorder.add_phase_time("backward", 0.4)
    recorder.add_phase_time("other", 0.8, since=closure)
    recorder.add_phase_time("optimizer", 1.0, since=optimizer)
    clock.now += 1.0
    recorder.step_boundary("optimizer")


def test_nested_phases_count_once_in_the_innermost() -> None:
    recorder, clock = recorder_on_a_clock()
    for _ in range(3):
        closure_step(recorder, clock)
    snapshot = recorder.snapshot()
    # The optimizer keeps 0.2 s of its 1.0; the closure's own 0.1 s and the
    # 0.5 s before the step are other.
    assert snapshot["phase_seconds"] == pytest.approx(
        {"forward": 0.9, "backward": 1.2, "optimizer": 0.6, "other": 1.8})
    assert sum(snapshot["phase_seconds"].values()) == pytest.approx(
        snapshot["step_seconds_sum"])
    assert snapshot["phase_split"] == "split"


def test_a_step_without_backward_says_so_and_its_rest_is_not_other() -> None:
    recorder, clock = recorder_on_a_clock()
    recorder.add_phase_time("forward", 0.25)
    recorder.add_phase_time("other", 0.1)  # a closure's own time: other only in a split
    recorder.add_phase_time("optimizer", 0.25)
    clock.now += 1.0
    recorder.step_boundary("optimizer")
    snapshot = recorder.snapshot()
    assert snapshot["phase_seconds"] == pytest.approx(
        {"forward": 0.25, "optimizer": 0.25, "unsplit": 0.5})
    assert snapshot["phase_split"] == "backward not seen"


def test_a_step_the_hooks_cannot_split_is_unsplit_and_says_why() -> None:
    recorder, clock = recorder_on_a_clock()
    recorder.unsplit_reason = COMPILED_GRAPH
    clock.now += 1.0
    recorder.step_boundary("optimizer")
    snapshot = recorder.snapshot()
    assert snapshot["phase_seconds"] == {"unsplit": 1.0}
    assert snapshot["phase_split"] == "not split: compiled graph"


def test_phases_past_the_step_are_scaled_to_it() -> None:
    recorder, clock = recorder_on_a_clock()
    recorder.add_phase_time("forward", 0.9)
    recorder.add_phase_time("backward", 0.9)
    clock.now += 1.2
    recorder.step_boundary("optimizer")
    phases = recorder.snapshot()["phase_seconds"]
    assert phases == pytest.approx({"forward": 0.6, "backward": 0.6})


def test_a_phase_only_timed_steps_see_is_estimated_for_every_step() -> None:
    """Keras's forward comes from its layers, timed one step in three; backward
    and the optimizer are timed every step. Every step adds up when it ends,
    so every window does."""
    recorder, clock = recorder_on_a_clock(LayerSampling(every=3))
    sums = []
    for _ in range(12):
        timed = recorder.layer_step
        if timed:
            recorder.add_phase_time("forward", 0.2)
        recorder.add_phase_time("backward", 0.3)
        recorder.add_phase_time("optimizer", 0.1)
        clock.now += 1.0
        recorder.step_boundary("optimizer")
        snapshot = recorder.snapshot()
        sums.append((sum(snapshot["phase_seconds"].values()), snapshot["step_seconds_sum"]))
    assert all(phases == pytest.approx(steps) for phases, steps in sums)
    phases = recorder.snapshot()["phase_seconds"]
    # The first two steps came before any timed one: their forward was not seen.
    assert phases == pytest.approx({"forward": 2.0, "backward": 3.6, "optimizer": 1.2,
                                    "other": 4.0, "unsplit": 1.2})
    assert recorder.snapshot()["phase_split"] == "split"


def probe_sample(phases: dict[str, float], split: str) -> ProbeSample:
    message = {"ok": True, "probe": {
        "step_source": "keras", "steps": {"steady": 10, "warmup": 2}, "samples": {},
        "step_buckets": [1.0], "step_bucket_counts": [10, 0], "step_seconds_sum": 2.0,
        "last_step_seconds": 0.2, "phase_seconds": phases, "layers": [], "hook_errors": 0,
        "phase_split": split}}
    return ProbeSample.from_reply(4242, message)


def test_the_split_state_reaches_prometheus() -> None:
    sample = probe_sample({"unsplit": 2.0}, COMPILED_GRAPH)
    assert sample.phase_split == COMPILED_GRAPH
    families = {family.name: family for family in probe_families(4242, True, sample)}
    (info,) = families["dlprof_step_phase_split_info"].samples
    assert info.labels == {"pid": "4242", "job_id": "", "rank": "",
                           "split": COMPILED_GRAPH} and info.value == 1
    older = dataclasses.replace(sample, phase_split=None)  # a probe without the field
    families = {family.name: family for family in probe_families(4242, True, older)}
    assert families["dlprof_step_phase_split_info"].samples == []


@pytest.mark.parametrize(("phases", "split", "line"), [
    ({"unsplit": 2.0}, COMPILED_GRAPH, "step split   not split: compiled graph: unsplit 100%"),
    ({"forward": 0.5, "optimizer": 0.1, "unsplit": 1.4}, "backward not seen",
     "step split   backward not seen: forward 25%  optimizer 5%  unsplit 70%"),
    ({"backward": 0.8, "forward": 0.5, "optimizer": 0.2, "other": 0.5}, "split",
     "step split   backward 40%  forward 25%  optimizer 10%  other 25%"),
])
def test_the_summary_prints_a_split_that_sums_to_the_steps_or_says_why_not(
        phases: dict[str, float], split: str, line: str) -> None:
    summary = Summary()
    summary.add(dataclasses.replace(full_snapshot(), probe=probe_sample(phases, split)))
    assert f"\n  {line}\n" in summary.render(4242, target_exited=False)
