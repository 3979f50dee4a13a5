"""Aggregates what the framework hooks see into bounded counters.

Hooks run on the training thread, so every method here is a few additions;
the agent reads a copy once per interval through ``snapshot()``. PyTorch's
default hooks do not even call these: they stamp events into a ring
(``events``, ``torch_steps``) that ``drain()`` replays in order, on the probe's
thread at each snapshot, or on the job's thread first thing in any method here
that adds to the totals, so every addition lands in the step it happened in. Memory is
bounded: fixed histogram buckets and at most ``max_layers`` layer names.

Layer time is duty-cycled (``LayerSampling``): the layer hooks are installed
for one step in N and removed for the others, which then take the framework's
fast path. A timed step's layer times are multiplied by the number of steps it
stands for, so the layer counters estimate every step's layer time and their
rates read as before; ``layer_sampled_steps`` counts the timed steps.

Phases are disjoint by construction: each moment of a step belongs to one
phase, the innermost. A hook times a phase with ``phase_mark()`` at its start
and ``add_phase_time(..., since=mark)`` at its end, which subtracts whatever
phases were recorded in between: forward and backward inside an optimizer's
closure count as forward and backward, and the optimizer keeps its own time.
Each steady step is split when it closes, so the phases add up to the step
time at every snapshot. A phase that only timed steps see (TensorFlow's
forward, from its layers) is estimated for an untimed step from the latest
timed one's proportions. The rest of the step is ``other`` when forward and
backward were both seen, else ``unsplit``, and ``phase_split`` says why.

``exchange`` is the time a rank of a multi-process job waited for its peers:
collectives called from Python (``torch_collectives``) and, with the model's
phases, DDP's wait for its gradient all-reduce at the end of backward
(``torch_hooks``). Like every phase it is innermost: a collective inside the
forward (SyncBatchNorm's) is taken out of the forward. A rank's own time per
step is the step time less its exchange.

Kept in one file: the totals, the duty cycle that decides which steps are timed, and
the replay's unchecked adders share one step's state and its lock.
"""

from __future__ import annotations

import bisect
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from dlprof_agent.probe.messages import (
    COMPILED_PHASE,
    DEFAULT_WARMUP_STEPS,
    OTHER,
    SPLIT,
    RecorderSnapshot,
)

if TYPE_CHECKING:
    from dlprof_agent.probe.trace_window import Capture

# Upper bounds in seconds; a CPU step of a small CNN sits near the middle.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DEFAULT_MAX_LAYERS = 512
OTHER_PHASE = "other"  # the step's rest, when forward and backward were seen
UNSPLIT_PHASE = "unsplit"  # the step's rest, when they were not: not read as "other"
FORWARD_NOT_SEEN = "forward not seen"
BACKWARD_NOT_SEEN = "backward not seen"
COMPILED_GRAPH = "not split: compiled graph"
SPLIT_OFF = "not split: turned off"  # the agent asked for no phases (--no-split)
DEFAULT_LAYER_BUDGET = 0.01  # layer timing may add this fraction of step time
PRICE_EVERY = 16  # stamping hooks time themselves on one call in this many
# Under a budget: one timed step in MIN_SAMPLE_INTERVAL at most (so a timed step
# costing up to 5% stays within 1% even if its cost is misjudged), one in
# MAX_SAMPLE_INTERVAL at least, and one in FIRST_SAMPLE_INTERVAL until the cost is known.
MIN_SAMPLE_INTERVAL = 5
MAX_SAMPLE_INTERVAL = 1000
FIRST_SAMPLE_INTERVAL = 8
BASELINE_STEPS = 63  # untimed step times kept: their median is the baseline
COST_SAMPLES = 15  # timed steps' extra times kept: their median is the cost
MIN_COST_SAMPLES = 3

_Hook = TypeVar("_Hook", bound=Callable[..., Any])


class StampedEvents(Protocol):
    """What a framework's hot path stamps instead of calling the recorder
    (``torch_steps.StepEvents``): replayed in order by ``Recorder.drain``."""

    read: int  # events replayed, and written: the ring is caught up when they are equal
    written: int

    def replay(self, recorder: Recorder) -> None: ...

    def reset(self) -> None: ...


def priced(hook: _Hook) -> _Hook:
    """A hook method whose time, entry to exit, adds to its recorder's
    ``hook_seconds``: the probe's own cost on the job's threads, which it reports.
    The hooks do not block, so their wall time is CPU time. perf_counter, not the
    recorder's clock: tests replace that one, and this measures the real cost."""
    clock = time.perf_counter

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        entered = clock()
        try:
            return hook(self, *args, **kwargs)
        finally:
            self.recorder.hook_seconds += clock() - entered

    timed.__name__ = hook.__name__
    timed.__doc__ = hook.__doc__
    return timed  # type: ignore[return-value]


# Who marks step boundaries, weakest first. A stronger source, once seen, wins:
# an explicit probe.step() call beats optimizer hooks, which beat the fallbacks.
# An eager TensorFlow optimizer's apply marks custom loops; Keras's fit, which
# calls it too, outranks it.
SOURCE_RANK = {"forward": 1, "tf_function": 1, "tf_optimizer": 2, "keras": 3, "optimizer": 3,
               "manual": 4}


class LayerSampling:
    """Which steps get their layers timed: one in ``every``, or as often as the
    budget allows, measured as a timed step's time minus the median of recent
    untimed steps."""

    def __init__(self, *, budget: float = DEFAULT_LAYER_BUDGET, every: int = 0) -> None:
        self.budget = budget
        self.every = every  # > 0: a fixed rate, the budget is not consulted
        self.interval = every or FIRST_SAMPLE_INTERVAL
        self.since_sample = 0  # steady steps closed since the last timed one
        self.cost_seconds = 0.0  # what the timed steps added over untimed ones, in all
        self._baseline: deque[float] = deque(maxlen=BASELINE_STEPS)
        self._costs: deque[float] = deque(maxlen=COST_SAMPLES)
        self._after_sample = False  # removing the hooks lands in the step after one

    def closed(self, seconds: float, sampled: bool) -> bool:
        """A steady step of ``seconds`` closed; returns whether to time the next."""
        if sampled:
            self.since_sample = 0
            if len(self._baseline) >= MIN_COST_SAMPLES:
                cost = seconds - statistics.median(self._baseline)
                self._costs.append(cost)
                self.cost_seconds += max(0.0, cost)
            self._after_sample = True
        else:
            self.since_sample += 1
            if not self._after_sample:
                self._baseline.append(seconds)
            else:
                if self._costs:
                    # Taking the hooks out lands in the step after a timed one (and the
                    # caches they left cold): part of what timing a step costs.
                    after = seconds - statistics.median(self._baseline)
                    self._costs[-1] += after
                    self.cost_seconds += max(0.0, after)
                self._after_sample = False
                self._set_interval()
        return self.since_sample + 1 >= self.interval

    def _set_interval(self) -> None:
        """Once a timed step's cost is whole (the step after it has closed), and only
        then: held until the next timed step, the boundaries before it are known in
        advance (``untimed_boundaries_ahead``)."""
        if not self.every and len(self._costs) >= MIN_COST_SAMPLES and self._baseline:
            cost = self._typical_cost()
            wanted = cost / (self.budget * statistics.median(self._baseline))
            self.interval = min(MAX_SAMPLE_INTERVAL,
                                max(MIN_SAMPLE_INTERVAL, math.ceil(wanted - 1e-9)))

    def untimed_boundaries_ahead(self) -> int:
        """How many of the next step boundaries are sure to open untimed steps, told
        after an untimed step opened; 0 while the interval may still change."""
        if self._after_sample:
            return 0
        return max(0, self.interval - 2 - self.since_sample)

    def _typical_cost(self) -> float:
        """What a timed step adds on average, its largest recent cost left out: a mean,
        not a median, as the job pays it (a timed step that sometimes also meets a
        garbage collection costs that share too), robust to one stall of the machine's."""
        costs = sorted(self._costs)[:-1]
        return max(0.0, sum(costs) / len(costs))

    @property
    def cost_ratio(self) -> float | None:
        """What a timed step adds, as a fraction of an untimed one."""
        if len(self._costs) < MIN_COST_SAMPLES or not self._baseline:
            return None
        return self._typical_cost() / statistics.median(self._baseline)


class Recorder:
    """Step, phase and layer totals since the agent said start."""

    def __init__(self, *, warmup_steps: int = DEFAULT_WARMUP_STEPS,
                 max_layers: int = DEFAULT_MAX_LAYERS,
                 clock: Callable[[], float] = time.perf_counter,
                 layer_sampling: LayerSampling | None = None) -> None:
        self.max_layers = max_layers
        self.clock = clock
        self._lock = threading.Lock()
        # Stamped events waiting to be replayed (torch_steps), and the lock that keeps
        # one replay at a time; taken before ``_lock``, never inside it.
        self.events: StampedEvents | None = None
        self._drain_lock = threading.Lock()
        self.step_source = ""
        self._last_boundary: float | None = None
        self._pending_samples = 0
        self._pending_phases: dict[str, float] = {}
        self.steps = {"warmup": 0, "steady": 0}
        self.samples = {"warmup": 0, "steady": 0}
        self.bucket_counts = [0] * (len(STEP_BUCKETS) + 1)
        self.step_seconds_sum = 0.0
        self.last_step_seconds: float | None = None
        self.phase_seconds: dict[str, float] = {}
        self.phase_split = ""  # SPLIT, or why the latest steady step was not split
        # Set by hooks that know the step cannot be split (COMPILED_GRAPH); "" if it can.
        self.unsplit_reason = ""
        self.split = True  # False: no hook times a phase, and the step says why
        self._phase_total = 0.0  # every phase second recorded, for exclusive times
        self._timed_split: dict[str, float] = {}  # the latest timed step's phases
        # name -> [forward seconds, forward calls, backward seconds, backward calls],
        # estimated for all steady steps from the timed ones.
        self.layers: dict[str, list[float]] = {}
        self._pending_layers: dict[str, list[float]] = {}  # the step being timed
        self.layer_step = False  # the open step is timed: layer hooks are in
        self.layer_weight = 1  # the steps the open timed step stands for (kernel attribution)
        # None: no duty cycle, every steady step is timed.
        self._layer_sampling = layer_sampling
        self.layer_sampled_steps = 0
        # Called on the training thread after each boundary with ``layer_step``:
        # the framework hooks install or remove their layer hooks.
        self.layer_listeners: list[Callable[[bool], None]] = []
        # Boundaries the training thread may pass over without telling them
        # (``layer_boundary``), while ``_layer_state_version`` is the one it was told at.
        self._quiet_boundaries = 0
        self._quiet_version = self._layer_state_version = 0
        # Called as a boundary closes a step, wherever it is replayed: hooks that sum
        # layer time on their own (torch_hooks) add it here, to the step it belongs to.
        self.layer_flushes: list[Callable[[], None]] = []
        self.hook_errors = 0
        self.hook_error_kinds: dict[str, str] = {}
        self.hook_seconds = 0.0  # time in the priced hooks (``priced``)
        self.steady = False  # past warm-up: layer time counts from here
        # Hooks still finding the model (``torch_hooks``): until they have, no step is
        # seen whole, so warm-up lasts at least until ``discovery_ended``.
        self.discovering = False
        # A windowed trace being taken (kernel_tracer.Capture): sees each step boundary.
        self.capture: Capture | None = None
        self.set_warmup_steps(warmup_steps)

    def set_warmup_steps(self, steps: int) -> None:
        self._layer_state_version += 1
        self.warmup_steps = steps
        # Steady stays steady while the model is found again (hooks reinstalled).
        self.steady = self.steps["warmup"] >= steps and (self.steady or not self.discovering)
        self.layer_step = self.steady and self._layer_sampling is None

    @property
    def layer_sampling(self) -> LayerSampling | None:
        return self._layer_sampling

    @layer_sampling.setter
    def layer_sampling(self, sampling: LayerSampling | None) -> None:
        with self._lock:
            self._layer_state_version += 1
            self._layer_sampling = sampling
            self.layer_step = self.steady and sampling is None

    # Hot path: called by hooks on the training thread.

    def _catch_up(self) -> None:
        events = self.events
        if events is not None and events.read != events.written:
            self.drain()

    def drain(self) -> None:
        """Replay the stamped events not yet replayed, in order."""
        events = self.events
        if events is None or events.read == events.written:
            return
        with self._drain_lock:
            events.replay(self)

    def step_boundary(self, source: str, now: float | None = None) -> None:
        """A step ended (and the next began) at ``now``, as seen by ``source``."""
        now = self.clock() if now is None else now
        self._catch_up()
        capture = self.capture
        if capture is not None:
            capture.live = True  # this boundary is now, on the job's thread
        self.step_boundary_unchecked(source, now)
        self.tell_layer_listeners()

    def layer_boundary(self) -> None:
        """A step boundary was stamped on the job's thread, and layer hooks go in or
        out at boundaries (``--layers``, a trace window): replay it and tell them.
        Between a duty cycle's timed steps, the boundaries that cannot open one are
        passed over, each a replay of the ring the job's thread does not wait for."""
        quiet = self._quiet_boundaries
        if quiet and self._quiet_version == self._layer_state_version and self.capture is None:
            self._quiet_boundaries = quiet - 1
            return
        self.drain()
        capture = self.capture
        if capture is not None:
            capture.live = True  # its window opens at the next boundary, set up now
        self.tell_layer_listeners()
        version = self._layer_state_version
        sampling = self._layer_sampling
        if (sampling is None or self.layer_step or not self.steady or self.discovering
                or self.capture is not None):
            self._quiet_boundaries = 0
        else:
            self._quiet_boundaries = sampling.untimed_boundaries_ahead()
        self._quiet_version = version

    def tell_layer_listeners(self) -> None:
        """Whether the open step is timed, to the hooks that put layer hooks in and
        take them out: on the job's thread only, never from a replay on the probe's
        (a module's hooks changed while the job iterates them would break its call)."""
        layer_step = self.layer_step
        for listener in self.layer_listeners:
            listener(layer_step)

    def step_boundary_unchecked(self, source: str, now: float) -> None:
        """``step_boundary`` for the replay, which is itself the catching up; the
        listeners are the caller's to tell."""
        rank = SOURCE_RANK.get(source, 0)
        with self._lock:
            current = SOURCE_RANK.get(self.step_source, 0)
            if rank < current:
                return
            for flush in self.layer_flushes:
                flush()
            capture = self.capture
            if capture is not None:
                capture.step(now)
            if rank > current:  # a better source appeared: restart from here
                self.step_source = source
                self._restart(now)
                return
            previous = self._last_boundary
            self._last_boundary = now
            if previous is None:
                self._pending_samples = 0
                self._pending_phases.clear()
                self._pending_layers.clear()
            else:
                self._close_step(now - previous)
            # As _close_step will weigh this step's layer time when it closes.
            sampling = self._layer_sampling
            self.layer_weight = (sampling.since_sample + 1
                                 if self.layer_step and sampling is not None else 1)

    def add_samples(self, count: int) -> None:
        self._catch_up()
        self._pending_samples += count

    def add_samples_unchecked(self, count: int) -> None:
        self._pending_samples += count

    def add_layer_time(self, layer: str, phase: str, seconds: float) -> None:
        """Called for every layer call: kept to a few additions."""
        events = self.events
        if events is not None and events.read != events.written:  # _catch_up, inline
            self.drain()
        if not self.steady:
            return  # warm-up layers (first calls, allocator growth) would skew the split
        stats = self._pending_layers.get(layer)
        if stats is None:
            if layer not in self.layers and len(self.layers) + len(
                    self._pending_layers) >= self.max_layers:
                layer = OTHER
            stats = self._pending_layers.setdefault(layer, [0.0, 0, 0.0, 0])
        if phase == "forward":
            stats[0] += seconds
            stats[1] += 1
        else:
            stats[2] += seconds
            stats[3] += 1

    def add_layer_stats(self, layer: str, stats: list[float]) -> None:
        """A timed step's [forward seconds, calls, backward seconds, calls] for
        ``layer``, summed by its hooks (``layer_flushes``)."""
        if not self.steady:
            return
        pending = self._pending_layers.get(layer)
        if pending is None:
            if layer not in self.layers and len(self.layers) + len(
                    self._pending_layers) >= self.max_layers:
                layer = OTHER
            pending = self._pending_layers.setdefault(layer, [0.0, 0, 0.0, 0])
        for at in range(4):
            pending[at] += stats[at]

    def phase_mark(self) -> float:
        """Taken where a phase starts, for ``add_phase_time(since=...)`` at its end."""
        self._catch_up()
        return self._phase_total

    @property
    def phase_total(self) -> float:
        """``phase_mark`` for the replay."""
        return self._phase_total

    def add_phase_time(self, phase: str, seconds: float, since: float | None = None) -> None:
        """``seconds`` of ``phase`` in the open step; with ``since`` (a ``phase_mark``),
        less the phases recorded meanwhile, which were inside it."""
        self._catch_up()
        self.add_phase_time_unchecked(phase, seconds, since)

    def add_phase_time_unchecked(self, phase: str, seconds: float,
                                 since: float | None = None) -> None:
        if since is not None:
            seconds = max(0.0, seconds - (self._phase_total - since))
        self._phase_total += seconds
        self._pending_phases[phase] = self._pending_phases.get(phase, 0.0) + seconds

    def discovery_started(self) -> None:
        """Hooks are going in that must find the model first: a job with no steady
        step yet stays in warm-up until ``discovery_ended``."""
        with self._lock:
            self._layer_state_version += 1
            self.discovering = True
            if not self.steps["steady"]:
                self.steady = self.layer_step = False

    def discovery_ended(self) -> None:
        """The hooks have found the model, or stopped looking: the steps from the next
        boundary are seen whole, and warm-up may end (on the job's thread, after the
        boundary that ended discovery was stamped)."""
        self._catch_up()
        with self._lock:
            self._layer_state_version += 1
            self.discovering = False
            if not self.steady and self.steps["warmup"] >= self.warmup_steps:
                self._end_warmup()

    def hook_failed(self, where: str, error: BaseException) -> None:
        self.hook_errors += 1
        if len(self.hook_error_kinds) < 16:
            self.hook_error_kinds.setdefault(where, f"{type(error).__name__}: {error}"[:200])

    def resume(self) -> None:
        """The hooks are back after a pause: the next boundary starts a step, not
        one as long as the pause."""
        self.drain()
        if self.events is not None:
            self.events.reset()
        self.restart_steps()

    def restart_steps(self) -> None:
        """The next boundary starts a step: what came before it was not all seen."""
        with self._lock:
            self._layer_state_version += 1
            self._last_boundary = None

    # Internals, under the lock.

    def _restart(self, now: float) -> None:
        self._layer_state_version += 1
        self._last_boundary = now
        self._pending_samples = 0
        self._pending_phases.clear()
        self._pending_layers.clear()
        self.layer_step = False

    def _end_warmup(self) -> None:
        self.steady = True
        self.layer_step = self._layer_sampling is None or self._layer_sampling.interval <= 1

    def _close_step(self, seconds: float) -> None:
        samples = self._pending_samples
        phases = self._pending_phases
        layers = self._pending_layers
        self._pending_samples = 0
        self._pending_phases = {}
        self._pending_layers = {}
        sampled, self.layer_step = self.layer_step, False
        if not self.steady:
            self.steps["warmup"] += 1
            self.samples["warmup"] += samples
            if self.steps["warmup"] >= self.warmup_steps and not self.discovering:
                self._end_warmup()
            if self.capture is not None:
                self.layer_step = True  # a trace window takes warm-up steps' layers too
            return
        sampling = self.layer_sampling
        weight = 1
        if sampling is None:
            self.layer_step = True  # no duty cycle: every steady step is timed
        else:
            weight = sampling.since_sample + 1  # the steps this timed one stands for
            self.layer_step = sampling.closed(seconds, sampled)
            if sampled:
                self.layer_sampled_steps += 1
            else:
                layers = {}  # a late hook call from a step that was not timed
        if self.capture is not None:
            self.layer_step = True  # a trace window takes every step's layers
        self._add_layers(layers, weight)
        self.steps["steady"] += 1
        self.samples["steady"] += samples
        self.last_step_seconds = seconds
        self.step_seconds_sum += seconds
        self.bucket_counts[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        self._split_step(seconds, phases, timed=sampling is None or sampled)

    def _split_step(self, seconds: float, phases: dict[str, float], *, timed: bool) -> None:
        """Adds one steady step's phases, which then sum to ``seconds``. ``phases`` is
        the closed step's own dict, changed in place (a step costs no copy)."""
        measured = sum(phases.values())
        if measured > seconds > 0:  # a phase ran past the boundary: keep the sum true
            phases = {phase: value * seconds / measured for phase, value in phases.items()}
            measured = seconds
        rest = max(0.0, seconds - measured)
        if not timed:
            # Phases only timed steps see take their share of the rest as in the
            # latest timed step.
            unseen = {phase: value for phase, value in self._timed_split.items()
                      if phase not in phases and value > 0}
            unseen_total = sum(unseen.values())
            if unseen_total > 0:
                for phase, value in unseen.items():
                    phases[phase] = rest * value / unseen_total
                rest = 0.0
        if not self.split:
            state = SPLIT_OFF
        elif self.unsplit_reason:
            state = self.unsplit_reason
        elif phases.get(COMPILED_PHASE, 0.0) > 0:
            state = SPLIT  # a compiled train step: its call, and what ran around it
        elif phases.get("forward", 0.0) <= 0:
            state = FORWARD_NOT_SEEN
        elif phases.get("backward", 0.0) <= 0:
            state = BACKWARD_NOT_SEEN
        else:
            state = SPLIT
        # What no hook saw: data loading, the loss, zero_grad, the loop's own Python.
        rest_phase = OTHER_PHASE if state == SPLIT else UNSPLIT_PHASE
        if rest > 0 or not phases or (rest_phase != OTHER_PHASE and OTHER_PHASE in phases):
            # A closure's own time is other only where forward and backward were seen.
            rest += phases.pop(OTHER_PHASE, 0.0) if rest_phase != OTHER_PHASE else 0.0
            phases[rest_phase] = phases.get(rest_phase, 0.0) + rest
        if timed:
            self._timed_split = phases
        for phase, value in phases.items():
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + value
        self.phase_split = state

    def _add_layers(self, layers: dict[str, list[float]], weight: int) -> None:
        for layer, (forward, forward_calls, backward, backward_calls) in layers.items():
            stats = self.layers.get(layer)
            if stats is None:
                name = OTHER if len(self.layers) >= self.max_layers else layer
                stats = self.layers.setdefault(name, [0.0, 0, 0.0, 0])
            stats[0] += weight * forward
            stats[1] += weight * forward_calls
            stats[2] += weight * backward
            stats[3] += weight * backward_calls

    # Read side: the probe thread, once per interval.

    def cpu_seconds(self) -> dict[str, float]:
        """Time the probe's hooks took on the job's threads; with layer timing, what
        the timed steps added over untimed ones, as the duty cycle measures it."""
        parts = {"hooks": self.hook_seconds}
        sampling = self._layer_sampling
        if sampling is not None:
            parts["layers"] = sampling.cost_seconds
        return parts

    def snapshot(self) -> RecorderSnapshot:
        self.drain()
        with self._lock:
            snapshot: RecorderSnapshot = {
                "step_source": self.step_source,
                "steps": dict(self.steps),
                "samples": dict(self.samples),
                "step_buckets": list(STEP_BUCKETS),
                "step_bucket_counts": list(self.bucket_counts),
                "step_seconds_sum": self.step_seconds_sum,
                "last_step_seconds": self.last_step_seconds,
                "phase_seconds": dict(self.phase_seconds),
                "layers": [[name, *stats] for name, stats in list(self.layers.items())],
                "hook_errors": self.hook_errors,
                "hook_error_kinds": dict(self.hook_error_kinds),
            }
            if self.layer_sampling is not None:
                snapshot["layer_sampled_steps"] = self.layer_sampled_steps
            if self.phase_split:
                snapshot["phase_split"] = self.phase_split
            return snapshot
