"""The PyTorch step's hot path: what the default split's hooks stamp, and how the
stamps become steps and phases.

Each of the four hooks a step meets (the model's forward pre and post hooks, the
optimizer's step pre and post hooks) only stamps: an event, the time and one value,
into a ring allocated once (``StepEvents.words``, three words an event). The
recorder replays the ring in order (``Recorder.drain``): on the probe's thread when
the agent asks for a snapshot, or on the job's thread just before anything that adds
to the recorder directly (a collective's wait, a layer's time, a step boundary that
puts layer hooks in or takes them out), so the recorder sees everything in the order
it happened. A step then costs the job four stamps, not the aggregation.

Phase boundaries that can be derived are not hooked. Backward runs from the end of the
model's forward to the start of the optimizer's step, or to the end of an optimizer's
closure (Lightning's automatic optimization): the loss is part of it. Only where that
end does not mark backward's (a loop that updates its parameters by hand, several
forwards before one optimizer step, DDP, whose wait is ``exchange``) does a pre-hook
on the output's autograd node, with an end-of-backward callback, still mark backward
each step (``torch_hooks``); ``FORWARD_ENDED``'s value says which.

A ``torch.compile``'d function called with no phase open (a compiled train step,
whose forward and backward the model's hooks never see) is its own phase,
``compiled``, stamped by two hooks on its compile context (``torch_hooks``); backward
is derived from its end, as from the forward's, for a loop whose backward runs after
it. Compiled calls inside a phase (a compiled loss, a compiled submodule) are that
phase's.

A ring the replay does not keep up with (an agent that stopped reading for minutes
of millisecond steps) loses its oldest events: they are counted, and the steps resume
at the next boundary, as after a pause.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlprof_agent.probe.messages import COMPILED_PHASE
from dlprof_agent.probe.recorder import OTHER_PHASE

if TYPE_CHECKING:
    from dlprof_agent.probe.recorder import Recorder

# Events; a float each, as the ring holds floats.
FORWARD_STARTED = 1.0  # value: the batch's samples
FORWARD_ENDED = 2.0  # value: 1.0 where backward is derived, 0.0 where it is hooked
OPTIMIZER_STARTED = 3.0
OPTIMIZER_ENDED = 4.0  # value: 1.0 for the optimizer whose steps are the job's steps
CLOSURE_STARTED = 5.0
CLOSURE_ENDED = 6.0
COMPILED_STARTED = 7.0  # value: the batch's samples (0 where unknown)
COMPILED_ENDED = 8.0  # value: as FORWARD_ENDED's

STAMP_SLOTS = 1 << 14  # events: 16k, 384 KiB; seconds of 1 ms steps between replays
WORDS_PER_EVENT = 3


class StepEvents:
    """The ring the hooks write and ``replay`` reads. One writer, the job's training
    thread; the replay runs under the recorder's drain lock. Under the GIL an event's
    words are written before ``written`` counts it, so a replay never reads half an
    event."""

    def __init__(self, slots: int = STAMP_SLOTS) -> None:
        assert slots & (slots - 1) == 0, "a power of two"
        self.words = [0.0] * (WORDS_PER_EVENT * slots)
        self.mask = slots - 1
        self.written = 0
        self.read = 0
        self.lost = 0  # events overwritten before a replay read them
        # Set by the replay where the derived backward would be wrong (several forwards
        # in one step): the hooks mark backward from then on.
        self.several_forwards = False
        self._forward: tuple[float, float] | None = None  # (started, phase mark)
        self._backward: tuple[float, float] | None = None  # derived, open since forward
        self._optimizer: tuple[float, float] | None = None
        self._closure: tuple[float, float] | None = None
        self._compiled: tuple[float, float] | None = None  # a compiled call with no phase
        self._compiled_depth = 0  # compiled calls open, nested ones included
        self._compiled_samples = 0  # the timed call's, unless a forward inside counts them

    def stamp(self, kind: float, now: float, value: float = 0.0) -> None:
        """One event (the hooks write theirs inline, the same way)."""
        written = self.written
        at = (written & self.mask) * WORDS_PER_EVENT
        words = self.words
        words[at] = kind
        words[at + 1] = now
        words[at + 2] = value
        self.written = written + 1

    def pending(self) -> bool:
        """Events written and not replayed yet."""
        return self.read != self.written

    def reset(self) -> None:
        """Forget the open phases: the hooks were out for a while."""
        self._forward = self._backward = self._optimizer = self._closure = None
        self._compiled = None
        self._compiled_depth = 0

    def replay(self, recorder: Recorder) -> None:
        """Everything written since the last replay, in order, into ``recorder``'s
        unchecked adders. Called only by ``Recorder.drain``, under its lock."""
        written, read = self.written, self.read
        slots = self.mask + 1
        if written - read > slots:
            self.lost += written - slots - read
            read = written - slots
            self.reset()
            recorder.restart_steps()
        words, mask = self.words, self.mask
        for index in range(read, written):
            at = (index & mask) * WORDS_PER_EVENT
            self._replay_one(recorder, words[at], words[at + 1], words[at + 2])
        if self.written - read > slots:  # lapped while replaying: the tail was not whole
            self.lost += self.written - slots - read
            self.reset()
            recorder.restart_steps()
            self.read = self.written
        else:
            self.read = written

    def _replay_one(self, recorder: Recorder, kind: float, now: float, value: float) -> None:
        if kind == FORWARD_STARTED:
            if self._backward is not None:  # a second forward before the optimizer
                self.several_forwards = True
                self._end_backward(recorder, now)
            recorder.step_boundary_unchecked("forward", now)
            recorder.add_samples_unchecked(int(value))
            self._compiled_samples = 0
            self._forward = (now, recorder.phase_total)
        elif kind == FORWARD_ENDED:
            if self._forward is None:
                return
            started, mark = self._forward
            self._forward = None
            recorder.add_phase_time_unchecked("forward", now - started, since=mark)
            if value:
                self._backward = (now, recorder.phase_total)
        elif kind == OPTIMIZER_STARTED:
            self._end_backward(recorder, now)
            self._optimizer = (now, recorder.phase_total)
        elif kind == CLOSURE_STARTED:
            self._closure = (now, recorder.phase_total)
        elif kind == CLOSURE_ENDED:
            self._end_backward(recorder, now)
            if self._closure is not None:
                started, mark = self._closure
                self._closure = None
                # The closure's own time (zero_grad, what precedes the forward): other.
                recorder.add_phase_time_unchecked(OTHER_PHASE, now - started, since=mark)
        elif kind == COMPILED_STARTED:
            self._compiled_depth += 1
            if (self._compiled_depth == 1 and self._forward is None and self._backward is None
                    and self._optimizer is None and self._closure is None):
                self._compiled = (now, recorder.phase_total)
                self._compiled_samples = int(value)
        elif kind == COMPILED_ENDED:
            self._compiled_depth = max(0, self._compiled_depth - 1)
            if self._compiled_depth == 0 and self._compiled is not None:
                started, mark = self._compiled
                self._compiled = None
                recorder.add_phase_time_unchecked(COMPILED_PHASE, now - started, since=mark)
                recorder.add_samples_unchecked(self._compiled_samples)
                if value:  # a backward run after it
                    self._backward = (now, recorder.phase_total)
        elif kind == OPTIMIZER_ENDED:
            if self._optimizer is not None:
                started, mark = self._optimizer
                self._optimizer = None
                recorder.add_phase_time_unchecked("optimizer", now - started, since=mark)
            if value:
                self._end_backward(recorder, now)  # an optimizer step with no pre-hook
                recorder.step_boundary_unchecked("optimizer", now)

    def _end_backward(self, recorder: Recorder, now: float) -> None:
        if self._backward is not None:
            started, mark = self._backward
            self._backward = None
            recorder.add_phase_time_unchecked("backward", now - started, since=mark)
