"""Findings that know what they do not know: the rules that read the step split
judge it only when every phase of the step was measured, and a rank of a process
group gets no input verdict until its time in collectives is measured as the
phase "exchange" (until then it is outside every phase, as waiting for input is).
The windows are the summaries of the issue's jobs."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from dlprof_agent.model.findings import rules
from dlprof_agent.model.findings.window import Window
from dlprof_agent.probe import distributed
from dlprof_agent.probe.messages import SPLIT
from dlprof_agent.probe.recorder import BACKWARD_NOT_SEEN, COMPILED_GRAPH
from tests.test_findings import gpu, point, probe, window


def job_window(phases: Sequence[tuple[str, float]], *, busy_cores: float = 1.0,
               runnable: int = 1, settings: Sequence[tuple[str, str]] = (),
               gpu_utilization: float | None = None) -> Window:
    """Two seconds of 20 steady steps of 0.1 s, split as ``phases`` (shares)."""
    gpu_sample = None if gpu_utilization is None else gpu(utilization=gpu_utilization)
    seconds = tuple((phase, 2.0 * share) for phase, share in phases)
    return window(point(0.0, runnable=runnable, gpu_sample=gpu_sample,
                        probe_sample=probe(settings=settings)),
                  point(2.0, user=2.0 * busy_cores, runnable=runnable, gpu_sample=gpu_sample,
                        probe_sample=probe(steps=20, step_seconds=2.0, phases=seconds,
                                           settings=settings)))


FULL_SPLIT_WAITING = (("forward", 0.15), ("backward", 0.15), ("optimizer", 0.05),
                      ("other", 0.65))


def test_a_full_split_with_most_of_the_step_unseen_is_still_input_bound() -> None:
    check = rules.input_bound(job_window(FULL_SPLIT_WAITING,
                                         settings=(("process_group", "none"),)))
    assert check is not None and check.holds
    assert check.evidence["other_step_ratio"] == pytest.approx(0.65)


def test_a_compiled_train_step_is_a_full_split() -> None:
    """torch.compile'd forward and backward are one phase, "compiled": with the
    optimizer's, the rest of the step is what no hook saw, and is read as such."""
    waiting = rules.input_bound(job_window((("compiled", 0.3), ("optimizer", 0.05),
                                            ("other", 0.65))))
    assert waiting is not None and waiting.holds
    assert waiting.evidence["other_step_ratio"] == pytest.approx(0.65)
    # The trainers tier's compiled_step, as measured: busy, not waiting.
    healthy = rules.input_bound(job_window((("compiled", 0.91), ("optimizer", 0.04),
                                            ("other", 0.04), ("backward", 0.01))))
    assert healthy is not None and not healthy.holds
    assert healthy.evidence["other_step_ratio"] == pytest.approx(0.04)
    # Without the optimizer's phase, it is partial like any other.
    partial = rules.input_bound(job_window((("compiled", 0.3), ("other", 0.7))))
    assert partial is not None and "other_step_ratio" not in partial.evidence


def test_keras_eager_without_backward_and_optimizer_is_not_input_bound() -> None:
    # The Keras fit(run_eagerly=True): forward 13%, other 83%, with the
    # tape's gradient and the optimizer's apply in "other". The host computes.
    check = rules.input_bound(job_window((("forward", 0.13), ("other", 0.87))))
    assert check is not None and not check.holds
    assert "other_step_ratio" not in check.evidence


def test_a_loop_without_torch_optim_is_not_input_bound() -> None:
    # pytorch/examples word_language_model: manual SGD, its update in "other".
    check = rules.input_bound(job_window((("forward", 0.2), ("backward", 0.3),
                                          ("other", 0.5))))
    assert check is not None and not check.holds


def test_a_partial_split_still_sees_a_host_that_sleeps() -> None:
    # The phases missing, the rule falls back to what it has: CPU and threads.
    check = rules.input_bound(job_window((("forward", 0.05), ("other", 0.95)),
                                         busy_cores=0.1, runnable=0))
    assert check is not None and check.holds


@pytest.mark.parametrize("said", [BACKWARD_NOT_SEEN, COMPILED_GRAPH])
def test_a_step_the_probe_says_is_not_split_is_not_read_as_one(said: str) -> None:
    window = job_window(FULL_SPLIT_WAITING)
    last = window.last
    assert last.probe is not None
    window = Window((window.first, dataclasses.replace(
        last, probe=dataclasses.replace(last.probe, phase_split=said))))
    check = rules.input_bound(window)
    assert check is not None and not check.holds
    assert "other_step_ratio" not in check.evidence
    told_split = Window((window.first, dataclasses.replace(
        last, probe=dataclasses.replace(last.probe, phase_split=SPLIT))))
    split = rules.input_bound(told_split)
    assert split is not None and split.holds


@pytest.mark.parametrize("group", ["gloo:2", "nccl:8", "tf_config:2"])
def test_a_rank_of_a_process_group_gets_no_input_verdict(group: str) -> None:
    # The torchrun DDP job: other 70% on both ranks, spent in the all-reduce.
    settings = (("process_group", group),)
    assert rules.input_bound(job_window(FULL_SPLIT_WAITING, settings=settings)) is None
    sleeping = job_window((("other", 1.0),), busy_cores=0.1, runnable=0, settings=settings)
    assert rules.input_bound(sleeping) is None


# The straggler job, measured (tests/test_probe_exchange_ddp.py): rank 0
# waits in DDP's all-reduce while rank 1 sleeps 20 ms in its input every step.
WAITING_RANK = (("forward", 0.015), ("backward", 0.025), ("optimizer", 0.005),
                ("exchange", 0.92), ("other", 0.035))
SLOW_RANK = (("forward", 0.02), ("backward", 0.05), ("optimizer", 0.005),
             ("exchange", 0.09), ("other", 0.835))


@pytest.mark.parametrize("group", ["gloo:2", "nccl:8"])
def test_a_rank_whose_exchange_was_measured_gets_an_input_verdict_again(group: str) -> None:
    settings = (("process_group", group),)
    waiting = rules.input_bound(job_window(WAITING_RANK, busy_cores=0.1, runnable=0,
                                           settings=settings))
    assert waiting is not None and not waiting.holds
    assert waiting.evidence["exchange_step_ratio"] == pytest.approx(0.92)
    assert waiting.evidence["other_step_ratio"] == pytest.approx(0.035)
    slow = rules.input_bound(job_window(SLOW_RANK, busy_cores=0.1, runnable=0,
                                        settings=settings))
    assert slow is not None and slow.holds


def test_a_measured_exchange_without_a_full_split_keeps_the_gate() -> None:
    # Without layer timing DDP's wait is not measured (it is in "unsplit"), however
    # much of it a collective called from Python was: the rank stays unjudged.
    settings = (("process_group", "gloo:2"),)
    partial = job_window((("optimizer", 0.02), ("exchange", 0.1), ("unsplit", 0.88)),
                         busy_cores=0.1, runnable=0, settings=settings)
    assert rules.input_bound(partial) is None
    window = job_window(WAITING_RANK, settings=settings)
    last = window.last
    assert last.probe is not None
    not_split = Window((window.first, dataclasses.replace(
        last, probe=dataclasses.replace(last.probe, phase_split=COMPILED_GRAPH))))
    assert rules.input_bound(not_split) is None
    assert not window.exchange_unmeasured() and not_split.exchange_unmeasured()


def test_launch_bound_reads_a_ranks_input_once_its_exchange_is_measured() -> None:
    settings = (("process_group", "nccl:2"),)
    straggler = rules.launch_bound(job_window(SLOW_RANK, gpu_utilization=0.2,
                                              settings=settings))
    assert straggler is not None and not straggler.holds  # input_bound's case
    assert straggler.evidence["other_step_ratio"] == pytest.approx(0.835)
    unmeasured = rules.launch_bound(job_window(FULL_SPLIT_WAITING, gpu_utilization=0.2,
                                               settings=settings))
    assert unmeasured is not None and "other_step_ratio" not in unmeasured.evidence


def test_launch_bound_reads_input_only_from_a_full_split() -> None:
    # An idle GPU beside a busy launcher. A full split that says "input" leaves
    # it to input_bound; a partial one cannot say it, so the launcher is judged.
    waiting = rules.launch_bound(job_window(FULL_SPLIT_WAITING, gpu_utilization=0.2))
    assert waiting is not None and not waiting.holds
    partial = rules.launch_bound(job_window((("forward", 0.2), ("other", 0.8)),
                                            gpu_utilization=0.2))
    assert partial is not None and partial.holds
    assert "other_step_ratio" not in partial.evidence


def test_healthy_splits_of_every_trainer_raise_nothing() -> None:
    """The split of each healthy in-memory job of the issue, as measured, with a
    busy host: no rule that reads the split holds."""
    healthy = {
        "lightning": (("forward", 0.37), ("backward", 0.30), ("optimizer", 0.05),
                      ("other", 0.28)),
        "word_lm": (("forward", 0.20), ("backward", 0.30), ("other", 0.50)),
        "keras_eager": (("forward", 0.13), ("other", 0.87)),
        "keras_compiled": (("other", 1.0),),
        "hf_trainer": (("forward", 0.30), ("backward", 0.55), ("optimizer", 0.10),
                       ("other", 0.05)),
    }
    for name, phases in healthy.items():
        for rule in (rules.input_bound, rules.launch_bound):
            check = rule(job_window(phases))
            assert check is None or not check.holds, (name, rule.__name__, check)
    ddp = job_window((("forward", 0.1), ("backward", 0.15), ("optimizer", 0.05),
                      ("other", 0.7)), settings=(("process_group", "gloo:2"),))
    assert rules.input_bound(ddp) is None
    for group in ("gloo:2", "nccl:2"):
        measured = job_window(WAITING_RANK, settings=(("process_group", group),))
        for rule in (rules.input_bound, rules.launch_bound):
            check = rule(measured)
            assert check is None or not check.holds, (group, rule.__name__, check)


# ---- what the probe reports --------------------------------------------------------------------


@pytest.mark.parametrize(("config", "expected"), [
    (None, "none"),
    ("", "none"),
    ("not json", "none"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}),
     "none"),
    (json.dumps({"cluster": {"worker": ["a:1", "b:1"]}}), "tf_config:2"),
    (json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]}}),
     "tf_config:3"),
    (json.dumps(["a list"]), "none"),
])
def test_a_tensorflow_cluster_is_read_from_tf_config(config: str | None,
                                                     expected: str) -> None:
    environ = {} if config is None else {"TF_CONFIG": config}
    assert distributed.tensorflow_cluster(environ) == expected


def test_the_probe_reads_the_tf_config_task_rank_chief_first() -> None:
    cluster = {"chief": ["a:1"], "worker": ["b:1", "c:1"], "ps": ["d:1"]}
    config = {"cluster": cluster, "task": {"type": "worker", "index": 1}}
    assert distributed.tensorflow_rank({"TF_CONFIG": json.dumps(config)}) == {
        "rank": "2", "world_size": "3"}
    ps = {"cluster": cluster, "task": {"type": "ps", "index": 0}}
    assert distributed.tensorflow_rank({"TF_CONFIG": json.dumps(ps)}) == {}
    assert distributed.tensorflow_rank({"TF_CONFIG": "{not json"}) == {}
    assert distributed.tensorflow_rank({}) == {}


def test_a_torch_process_group_is_seen_once_initialised(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    assert distributed.process_group("torch") == {"process_group": "none"}
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(),
                            rank=0, world_size=1)
    try:
        # The probe's own rank outranks the environment's (docs/fleet-identity.md).
        assert distributed.process_group("torch") == {"process_group": "gloo:1",
                                                      "rank": "0", "world_size": "1"}
    finally:
        dist.destroy_process_group()
    assert distributed.process_group("torch") == {"process_group": "none"}
    assert torch.__name__ in sys.modules
    assert distributed.process_group("jax") == {}
