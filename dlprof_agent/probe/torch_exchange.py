"""The step phase ``exchange`` in PyTorch: time a rank waits for its peers.

**DDP's gradient all-reduce** (``DdpWait``). DistributedDataParallel launches a
bucket's all-reduce as soon as its gradients are ready, during backward, and
waits for all of them in ``finalize_backward``, a callback it queues on the
autograd engine when the last bucket is ready. The hooks' own end-of-backward
callback was queued earlier, when backward reached the model's output, so it
runs first; the engine runs its final callbacks in order, including those queued
while they run, so one more callback queued from there runs right after DDP's.
The time between the two is the wait that backward did not hide (and the copy of
the reduced buckets into the gradients). It is taken only for a model that holds
a DistributedDataParallel module, while a process group is initialized; without
one nothing is queued and nothing changes.

**Collectives called from Python** (``CollectiveTiming``). Each name in
``COLLECTIVES`` is replaced at its attribute of the ``torch.distributed`` module
by a wrapper (``functools.wraps``: the original's name, docstring and signature)
that calls the original with the same arguments and returns its result or lets
its exception through untouched. A synchronous call is timed from its call to
its return, less any phase recorded inside it. A call that returns a work handle
(``async_op=True``) only queued the collective: it is not timed, and the wait
that follows (``work.wait()``) is not seen. Code that bound a collective before
the probe came (``from torch.distributed import all_reduce``) calls the
original, untimed. ``remove()`` puts back the exact objects that were there; a
caller that still holds a wrapper (a call in flight, a name bound meanwhile)
goes straight through to the original once the timing is removed.

On NCCL a collective returns to the host once queued on its stream, and DDP's
finalize waits on the stream, not the host: the host-side exchange is then the
launch, and the wait shows where the host next synchronizes. CUPTI's NCCL kernel
records carry the GPU side.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from dlprof_agent.probe.messages import EXCHANGE_PHASE
from dlprof_agent.probe.patching import Patch
from dlprof_agent.probe.recorder import Recorder

# Collectives and blocking point-to-point calls whose caller waits for its peers.
# Those a torch release lacks are left out; all_gather_single and
# reduce_scatter_single are the newer names of the *_tensor ones.
COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "all_reduce", "all_to_all", "all_to_all_single", "barrier", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "monitored_barrier", "recv",
    "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send",
)


def holds_ddp(torch: Any, model: Any) -> bool:
    """Whether ``model`` is or holds a DistributedDataParallel module."""
    ddp = getattr(getattr(torch.nn, "parallel", None), "DistributedDataParallel", None)
    return ddp is not None and any(isinstance(module, ddp) for module in model.modules())


class DdpWait:
    """Times DDP's finalize: ``backward_ended()`` is called from the hooks'
    end-of-backward callback, on the thread that runs the engine's callbacks."""

    def __init__(self, recorder: Recorder, torch: Any) -> None:
        self.recorder = recorder
        self._torch = torch
        self.ddp = False  # set once the model is found
        self._started = 0.0
        self._mark = 0.0

    def backward_ended(self, now: float) -> None:
        if not self.ddp:
            return
        distributed = self._torch.distributed
        if not (distributed.is_available() and distributed.is_initialized()):
            return
        self._mark, self._started = self.recorder.phase_mark(), now
        self._torch.autograd.Variable._execution_engine.queue_callback(self._finalized)

    def _finalized(self) -> None:
        try:
            started, self._started = self._started, 0.0
            if started:
                self.recorder.add_phase_time(EXCHANGE_PHASE, self.recorder.clock() - started,
                                             since=self._mark)
        except Exception as error:
            self.recorder.hook_failed("ddp_wait", error)


class CollectiveTiming:
    """The wrappers of one probe session, in place between install() and remove()."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.active = False
        self._patches: list[Patch] = []

    def install(self, torch: Any) -> None:
        """Wrap the collectives that torch.distributed has, if it is available."""
        distributed = getattr(torch, "distributed", None)
        if self._patches or distributed is None or not distributed.is_available():
            return
        for name in COLLECTIVES:
            original = distributed.__dict__.get(name)
            if callable(original):
                self._patches.append(Patch(distributed, name, self._timed(original)))
        self.active = True
        for patch in self._patches:
            patch.apply()

    def remove(self) -> None:
        self.active = False
        patches, self._patches = self._patches, []
        for patch in reversed(patches):
            patch.undo()

    @property
    def wrapped(self) -> list[str]:
        return [patch.name for patch in self._patches]

    def _timed(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        timing = self
        recorder = self.recorder
        clock = recorder.clock

        @functools.wraps(collective)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not timing.active:
                return collective(*args, **kwargs)
            mark, started = recorder.phase_mark(), clock()
            result = collective(*args, **kwargs)
            timing._ended(result, started, mark)
            return result

        return timed

    def _ended(self, result: Any, started: float, mark: float) -> None:
        try:
            if result is not None and hasattr(result, "wait"):
                return  # async_op=True: only queued, its wait is elsewhere
            self.recorder.add_phase_time(EXCHANGE_PHASE, self.recorder.clock() - started,
                                         since=mark)
        except Exception as error:
            self.recorder.hook_failed("collective", error)
