"""Aggregates what the framework hooks see into bounded counters.

Hooks run on the training thread, so every method here is a few additions;
the agent reads a copy once per interval through ``snapshot()``. Memory is
bounded: fixed histogram buckets and at most ``max_layers`` layer names.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Any

# Upper bounds in seconds; a CPU step of a small CNN sits near the middle.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DEFAULT_WARMUP_STEPS = 10
DEFAULT_MAX_LAYERS = 512
OTHER_LAYER = "other"
PHASES = ("forward", "backward")

# Who marks step boundaries, weakest first. A stronger source, once seen, wins:
# an explicit probe.step() call beats optimizer hooks, which beat the fallbacks.
SOURCE_RANK = {"forward": 1, "tf_function": 1, "keras": 2, "optimizer": 2, "manual": 3}


class Recorder:
    """Step, phase and layer totals since the agent said start."""

    def __init__(self, *, warmup_steps: int = DEFAULT_WARMUP_STEPS,
                 max_layers: int = DEFAULT_MAX_LAYERS, clock: Any = time.perf_counter) -> None:
        self.max_layers = max_layers
        self.clock = clock
        self._lock = threading.Lock()
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
        # name -> [forward seconds, forward calls, backward seconds, backward calls]
        self.layers: dict[str, list[float]] = {}
        self.hook_errors = 0
        self.hook_error_kinds: dict[str, str] = {}
        self.steady = False  # past warm-up: layer time counts from here
        # A windowed trace being taken (kernel_tracer.Capture): sees each step boundary.
        self.capture: Any = None
        self.set_warmup_steps(warmup_steps)

    def set_warmup_steps(self, steps: int) -> None:
        self.warmup_steps = steps
        self.steady = self.steps["warmup"] >= steps

    # Hot path: called by hooks on the training thread.

    def step_boundary(self, source: str, now: float | None = None) -> None:
        """A step ended (and the next began) at ``now``, as seen by ``source``."""
        now = self.clock() if now is None else now
        rank = SOURCE_RANK.get(source, 0)
        with self._lock:
            current = SOURCE_RANK.get(self.step_source, 0)
            if rank < current:
                return
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
                return
            self._close_step(now - previous)

    def add_samples(self, count: int) -> None:
        self._pending_samples += count

    def add_layer_time(self, layer: str, phase: str, seconds: float) -> None:
        """Called for every layer call: kept to a few additions."""
        if not self.steady:
            return  # warm-up layers (first calls, allocator growth) would skew the split
        stats = self.layers.get(layer)
        if stats is None:
            if len(self.layers) >= self.max_layers:
                layer = OTHER_LAYER
            stats = self.layers.setdefault(layer, [0.0, 0, 0.0, 0])
        pending = self._pending_phases
        if phase == "forward":
            stats[0] += seconds
            stats[1] += 1
        else:
            stats[2] += seconds
            stats[3] += 1
        pending[phase] = pending.get(phase, 0.0) + seconds

    def add_phase_time(self, phase: str, seconds: float) -> None:
        """Time in a step that is not a layer's, such as the optimizer's update."""
        self._pending_phases[phase] = self._pending_phases.get(phase, 0.0) + seconds

    def hook_failed(self, where: str, error: BaseException) -> None:
        self.hook_errors += 1
        if len(self.hook_error_kinds) < 16:
            self.hook_error_kinds.setdefault(where, f"{type(error).__name__}: {error}"[:200])

    # Internals, under the lock.

    def _restart(self, now: float) -> None:
        self._last_boundary = now
        self._pending_samples = 0
        self._pending_phases.clear()

    def _close_step(self, seconds: float) -> None:
        samples = self._pending_samples
        phases = self._pending_phases
        self._pending_samples = 0
        self._pending_phases = {}
        if self.steps["warmup"] < self.warmup_steps:
            self.steps["warmup"] += 1
            self.samples["warmup"] += samples
            self.steady = self.steps["warmup"] >= self.warmup_steps
            return
        self.steps["steady"] += 1
        self.samples["steady"] += samples
        self.last_step_seconds = seconds
        self.step_seconds_sum += seconds
        self.bucket_counts[bisect.bisect_left(STEP_BUCKETS, seconds)] += 1
        measured = 0.0
        for phase, phase_seconds in phases.items():
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + phase_seconds
            measured += phase_seconds
        # What no hook saw: data loading, the loss, zero_grad, the loop's own Python.
        self.phase_seconds["other"] = (self.phase_seconds.get("other", 0.0)
                                       + max(0.0, seconds - measured))

    # Read side: the probe thread, once per interval.

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
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
