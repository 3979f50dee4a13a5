"""The exchange phase on real torch.distributed: a two-rank gloo DDP job on
127.0.0.1 whose rank 1 sleeps in its input before every step (the issue's
straggler), and the collective wrappers on a real one-rank gloo group.

Rank 0 waits for rank 1 in DDP's gradient all-reduce: that wait is its exchange,
not its input, so input_bound does not hold for it, and it does for rank 1."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlprof_agent.model.findings import rules
from dlprof_agent.model.findings.window import Window
from dlprof_agent.probe.messages import EXCHANGE_PHASE
from dlprof_agent.probe.recorder import Recorder
from dlprof_agent.probe.torch_exchange import COLLECTIVES, CollectiveTiming
from tests.conftest import REPO, agent_env, free_port
from tests.test_findings import point, probe, window

pytestmark = pytest.mark.slow

INPUT_SECONDS = 0.02  # rank 1's sleep before each step
STEPS = 40
SUM_TOLERANCE = 0.02
JOB_SECONDS = 300.0  # a deadline for a job that takes a few seconds


@dataclasses.dataclass(frozen=True)
class RankSplit:
    rank: int
    steps: int
    step_seconds: float  # the measured steps' sum
    phases: dict[str, float]  # seconds over the measured steps
    phase_split: str
    process_group: str
    cpu_seconds: float
    hook_errors: int

    def per_step(self, phase: str) -> float:
        return self.phases.get(phase, 0.0) / self.steps

    def window(self) -> Window:
        """The findings' window over these steps, as the agent would see them."""
        settings = (("process_group", self.process_group),)
        seconds = self.step_seconds
        before = probe(settings=settings)
        after = dataclasses.replace(
            probe(steps=self.steps, step_seconds=seconds, phases=tuple(self.phases.items()),
                  settings=settings), phase_split=self.phase_split)
        return window(point(0.0, probe_sample=before),
                      point(seconds, user=self.cpu_seconds, probe_sample=after))


def read_split(path: Path) -> RankSplit:
    result = json.loads(path.read_text())
    before, after = result["before"], result["after"]
    return RankSplit(
        rank=result["rank"],
        steps=after["steps"]["steady"] - before["steps"]["steady"],
        step_seconds=after["step_seconds_sum"] - before["step_seconds_sum"],
        phases={phase: seconds - before["phase_seconds"].get(phase, 0.0)
                for phase, seconds in after["phase_seconds"].items()},
        phase_split=after.get("phase_split", ""), process_group=result["process_group"],
        cpu_seconds=result["cpu_seconds"], hook_errors=after["hook_errors"])


@pytest.fixture(scope="module")
def straggler_job(tmp_path_factory: pytest.TempPathFactory) -> dict[int, RankSplit]:
    pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("ddp")
    port = str(free_port())
    ranks = []
    for rank in (0, 1):
        env = {**agent_env(), "RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        ranks.append(subprocess.Popen(
            [sys.executable, "-m", "tests.jobs.ddp_straggler", "--out",
             str(folder / f"rank{rank}.json"), "--slow-rank", "1",
             "--input-seconds", str(INPUT_SECONDS), "--steps", str(STEPS)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [job.communicate(timeout=JOB_SECONDS)[0] for job in ranks]
    finally:
        for job in ranks:
            if job.poll() is None:
                job.kill()
                job.wait()
    for job, output in zip(ranks, outputs, strict=True):
        assert job.returncode == 0, output
    return {rank: read_split(folder / f"rank{rank}.json") for rank in (0, 1)}


@pytest.mark.serial  # phase times of two ranks on the cores: the module's run is timed
def test_the_waiting_rank_spends_the_stragglers_input_in_exchange(
        straggler_job: dict[int, RankSplit]) -> None:
    healthy, slow = straggler_job[0], straggler_job[1]
    for split in (healthy, slow):
        assert split.steps == STEPS
        assert split.phase_split == "split"
        assert split.process_group == "gloo:2"
        assert split.hook_errors == 0
        assert {"forward", "backward", "optimizer", "other", EXCHANGE_PHASE} <= set(split.phases)
        assert min(split.phases.values()) >= 0
        assert sum(split.phases.values()) == pytest.approx(split.step_seconds,
                                                           rel=SUM_TOLERANCE)
    # Rank 0 waits in the all-reduce for most of rank 1's sleep, every step.
    assert healthy.per_step(EXCHANGE_PHASE) >= 0.5 * INPUT_SECONDS, healthy
    assert healthy.per_step("other") < 0.5 * INPUT_SECONDS, healthy
    # Rank 1's input carries its sleep; it hardly waits for rank 0.
    assert slow.per_step("other") >= INPUT_SECONDS, slow
    assert slow.per_step(EXCHANGE_PHASE) < 0.5 * INPUT_SECONDS, slow
    assert slow.per_step(EXCHANGE_PHASE) < healthy.per_step(EXCHANGE_PHASE)


@pytest.mark.serial  # phase times of two ranks on the cores: the module's run is timed
def test_only_the_rank_that_waits_for_input_is_input_bound(
        straggler_job: dict[int, RankSplit]) -> None:
    healthy = rules.input_bound(straggler_job[0].window())
    assert healthy is not None and not healthy.holds, healthy
    assert healthy.evidence["exchange_step_ratio"] >= 0.5
    slow = rules.input_bound(straggler_job[1].window())
    assert slow is not None and slow.holds, slow


# ---- the wrappers on a real process group ------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[Any]:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    torch.set_num_threads(1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_wrapped_collectives_keep_their_results_signatures_and_errors(
        one_rank_group: Any) -> None:
    import torch

    dist = one_rank_group
    originals = {name: dist.__dict__[name] for name in COLLECTIVES if name in dist.__dict__}
    assert {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
            "barrier", "all_to_all_single"} <= set(originals)
    recorder = Recorder(warmup_steps=0)
    timing = CollectiveTiming(recorder)
    timing.install(torch)
    try:
        assert sorted(timing.wrapped) == sorted(originals)
        for name, original in originals.items():
            wrapper = getattr(dist, name)
            assert wrapper is not original and wrapper.__wrapped__ is original
            assert wrapper.__name__ == original.__name__
            assert wrapper.__doc__ == original.__doc__
            assert inspect.signature(wrapper) == inspect.signature(original)
        recorder.step_boundary("manual")
        tensor = torch.arange(4.0)
        assert dist.all_reduce(tensor) is None
        assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0]
        gathered = torch.empty(4)
        dist.all_gather_into_tensor(gathered, torch.arange(4.0))
        assert gathered.tolist() == [0.0, 1.0, 2.0, 3.0]
        dist.barrier()
        objects: list[Any] = [None]
        dist.all_gather_object(objects, {"rank": 0})
        assert objects == [{"rank": 0}]
        work = dist.all_reduce(tensor, async_op=True)  # only queued: not timed
        work.wait()
        with pytest.raises(TypeError) as wrapped_error:
            dist.all_reduce("not a tensor")
        recorder.step_boundary("manual")
    finally:
        timing.remove()
    with pytest.raises(TypeError) as original_error:
        dist.all_reduce("not a tensor")
    assert str(wrapped_error.value) == str(original_error.value)
    for name, original in originals.items():
        assert dist.__dict__[name] is original
    assert recorder.phase_seconds.get(EXCHANGE_PHASE, 0.0) > 0
    assert recorder.hook_errors == 0


def test_a_wrapper_held_after_removal_passes_through(one_rank_group: Any) -> None:
    import torch

    dist = one_rank_group
    recorder = Recorder(warmup_steps=0)
    timing = CollectiveTiming(recorder)
    timing.install(torch)
    held = dist.all_reduce  # as `from torch.distributed import all_reduce` would
    timing.remove()
    assert dist.all_reduce is not held
    recorder.step_boundary("manual")
    tensor = torch.ones(2)
    held(tensor)
    recorder.step_boundary("manual")
    assert tensor.tolist() == [1.0, 1.0]
    assert EXCHANGE_PHASE not in recorder.phase_seconds


def test_the_probe_leaves_torch_distributed_as_it_found_it(one_rank_group: Any) -> None:
    from dlprof_agent.probe.torch_hooks import TorchHooks

    dist = one_rank_group
    before = dict(vars(dist))
    hooks = TorchHooks(Recorder(), layers=True)
    hooks.install()
    assert dist.all_reduce is not before["all_reduce"]
    hooks.remove()
    after = dict(vars(dist))
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
