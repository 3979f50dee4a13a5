"""The exchange phase without a framework: the collective wrappers on a module
laid out as torch.distributed is (a module attribute per collective,
``is_available()``), and the recorder keeping exchange disjoint from the phases
it runs inside. tests/test_probe_exchange_ddp.py runs them on torch."""

from __future__ import annotations

import inspect
import types
from typing import Any

import pytest

from dlprof_agent.probe.messages import EXCHANGE_PHASE, SPLIT
from dlprof_agent.probe.recorder import FORWARD_NOT_SEEN, Recorder
from dlprof_agent.probe.torch_exchange import COLLECTIVES, CollectiveTiming
from tests.test_probe_recorder import Clock


class PeersMissing(RuntimeError):
    pass


def distributed_module(clock: Clock, *, wait_seconds: float = 0.004) -> types.ModuleType:
    """A torch-like namespace whose torch.distributed has all_reduce (waits
    ``wait_seconds`` on ``clock``, calling ``while_waiting()`` if the module has
    one, then doubles its tensor in place), broadcast
    (returns a work handle when asked), barrier (fails when told) and one
    function that is no collective."""
    distributed = types.ModuleType("distributed")

    def all_reduce(tensor: list[float], op: str = "sum", group: Any = None,
                   async_op: bool = False) -> None:
        """Doubles ``tensor`` as two equal ranks would."""
        while_waiting = getattr(distributed, "while_waiting", None)
        if while_waiting is not None:
            while_waiting()
        clock.now += wait_seconds
        tensor[:] = [2 * value for value in tensor]

    class Work:
        def wait(self) -> bool:
            return True

    def broadcast(tensor: list[float], src: int, group: Any = None,
                  async_op: bool = False) -> Work | None:
        clock.now += wait_seconds
        return Work() if async_op else None

    def barrier(group: Any = None, *, fail: bool = False) -> None:
        clock.now += wait_seconds
        if fail:
            raise PeersMissing("rank 1 never came")

    def get_rank() -> int:
        return 0

    for function in (all_reduce, broadcast, barrier, get_rank):
        setattr(distributed, function.__name__, function)
    distributed.is_available = lambda: True  # type: ignore[attr-defined]
    torch = types.ModuleType("torch")
    torch.distributed = distributed  # type: ignore[attr-defined]
    return torch


def test_install_wraps_the_collectives_and_remove_puts_back_the_same_objects() -> None:
    clock = Clock()
    torch = distributed_module(clock)
    distributed: Any = torch.distributed
    before = dict(vars(distributed))
    timing = CollectiveTiming(Recorder(clock=clock))
    timing.install(torch)
    assert sorted(timing.wrapped) == ["all_reduce", "barrier", "broadcast"]
    assert set(timing.wrapped) <= set(COLLECTIVES)
    for name in timing.wrapped:
        wrapper, original = getattr(distributed, name), before[name]
        assert wrapper is not original and wrapper.__wrapped__ is original
        assert wrapper.__name__ == original.__name__ and wrapper.__doc__ == original.__doc__
        assert inspect.signature(wrapper) == inspect.signature(original)
    assert distributed.get_rank is before["get_rank"]
    timing.remove()
    after = dict(vars(distributed))
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)


def test_a_synchronous_collective_is_exchange_with_its_result_and_errors_unchanged() -> None:
    clock = Clock()
    torch = distributed_module(clock)
    distributed: Any = torch.distributed
    recorder = Recorder(warmup_steps=0, clock=clock)
    timing = CollectiveTiming(recorder)
    timing.install(torch)
    try:
        recorder.step_boundary("manual")
        tensor = [1.0, 2.0]
        assert distributed.all_reduce(tensor, "sum", async_op=False) is None
        assert tensor == [2.0, 4.0]
        with pytest.raises(PeersMissing, match="rank 1 never came"):
            distributed.barrier(fail=True)
        work = distributed.broadcast(tensor, 0, async_op=True)  # queued: not timed
        assert work.wait() is True
        clock.now += 0.010
        recorder.step_boundary("manual")
    finally:
        timing.remove()
    # The all-reduce's wait is exchange; the failed barrier and the queued
    # broadcast are the step's rest, as without the probe.
    assert recorder.phase_seconds[EXCHANGE_PHASE] == pytest.approx(0.004)
    assert sum(recorder.phase_seconds.values()) == pytest.approx(0.022)
    assert recorder.hook_errors == 0


def test_a_call_in_flight_when_the_timing_is_removed_still_returns() -> None:
    clock = Clock()
    torch = distributed_module(clock)
    distributed: Any = torch.distributed
    original = distributed.all_reduce
    recorder = Recorder(warmup_steps=0, clock=clock)
    timing = CollectiveTiming(recorder)
    timing.install(torch)
    held = distributed.all_reduce  # a name bound while the probe is in
    # The agent leaves while this rank waits for its peers.
    distributed.while_waiting = timing.remove
    recorder.step_boundary("manual")
    tensor = [1.0]
    assert held(tensor) is None and tensor == [2.0]
    assert distributed.all_reduce is original
    del distributed.while_waiting
    assert held(tensor) is None and tensor == [4.0]  # removed: straight through
    recorder.step_boundary("manual")
    # The call in flight is timed, as it began with the probe in; the later one not.
    assert recorder.phase_seconds[EXCHANGE_PHASE] == pytest.approx(0.004)
    assert recorder.hook_errors == 0


def test_exchange_is_taken_out_of_the_phase_it_runs_in() -> None:
    """SyncBatchNorm's all-gather inside the forward, ZeRO's broadcast inside the
    optimizer's step: each moment belongs to the innermost phase."""
    clock = Clock()
    recorder = Recorder(warmup_steps=0, clock=clock)
    recorder.step_boundary("manual")
    for outer, inner_exchange in (("forward", 0.003), ("optimizer", 0.002)):
        mark, started = recorder.phase_mark(), clock()
        clock.now += 0.001
        exchange_mark, exchange_started = recorder.phase_mark(), clock()
        clock.now += inner_exchange
        recorder.add_phase_time(EXCHANGE_PHASE, clock() - exchange_started,
                                since=exchange_mark)
        clock.now += 0.001
        recorder.add_phase_time(outer, clock() - started, since=mark)
    recorder.add_phase_time("backward", 0.004)
    clock.now += 0.004
    clock.now += 0.010  # the rest: input, loss
    recorder.step_boundary("manual")
    snapshot = recorder.snapshot()
    assert snapshot["phase_split"] == SPLIT
    phases = snapshot["phase_seconds"]
    assert phases["forward"] == pytest.approx(0.002)
    assert phases["optimizer"] == pytest.approx(0.002)
    assert phases[EXCHANGE_PHASE] == pytest.approx(0.005)
    assert phases["other"] == pytest.approx(0.010)
    assert sum(phases.values()) == pytest.approx(snapshot["step_seconds_sum"])


def test_exchange_stays_its_own_phase_in_a_step_that_is_not_split() -> None:
    # Without layer timing the rest is "unsplit"; the wait still is exchange.
    clock = Clock()
    recorder = Recorder(warmup_steps=0, clock=clock)
    recorder.step_boundary("optimizer")
    recorder.add_phase_time(EXCHANGE_PHASE, 0.006)
    recorder.add_phase_time("optimizer", 0.001)
    clock.now += 0.020
    recorder.step_boundary("optimizer")
    snapshot = recorder.snapshot()
    assert snapshot["phase_split"] == FORWARD_NOT_SEEN
    assert snapshot["phase_seconds"] == pytest.approx(
        {EXCHANGE_PHASE: 0.006, "optimizer": 0.001, "unsplit": 0.013})
