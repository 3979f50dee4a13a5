"""One attached agent's session in the probe: the options it asked for, the
framework hooks installed for it, its recorder and its kernel tracer."""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Protocol, cast, runtime_checkable

from dlprof_agent.probe.activity_binding import LayerIdSource
from dlprof_agent.probe.distributed import process_group
from dlprof_agent.probe.frameworks import FRAMEWORK_HOOKS, framework_imported
from dlprof_agent.probe.kernel_tracer import PAUSED, SWITCHED_OFF, KernelTracer
from dlprof_agent.probe.messages import (
    DEFAULT_WARMUP_STEPS,
    ErrorReply,
    SessionOptions,
    TraceStarted,
    TraceStatus,
)
from dlprof_agent.probe.recorder import (
    DEFAULT_LAYER_BUDGET,
    DEFAULT_MAX_LAYERS,
    MAX_SAMPLE_INTERVAL,
    LayerSampling,
    Recorder,
)

# An agent silent longer than its lease is taken for gone: three of its intervals
# and a margin, at least MIN_LEASE_SECONDS. Module values, read at each check, so
# tests can shorten them.
MIN_LEASE_SECONDS = 2.0
MAX_LEASE_SECONDS = 3600.0
LEASE_INTERVALS = 3
LEASE_MARGIN_SECONDS = 1.0
MAX_TRACE_STEPS = 100_000

DEFAULT_OPTIONS: SessionOptions = {"interval_seconds": 1.0, "layers": False, "split": True,
                                   "warmup_steps": DEFAULT_WARMUP_STEPS,
                                   "max_layers": DEFAULT_MAX_LAYERS, "agent_pid": 0,
                                   "kernels": True, "layers_budget": DEFAULT_LAYER_BUDGET,
                                   "layers_every": 0, "lease_seconds": 0.0, "paused": False}
_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "interval_seconds": (int, float), "layers": (bool,), "split": (bool,),
    "warmup_steps": (int,),
    "max_layers": (int,), "agent_pid": (int,), "kernels": (bool,),
    "layers_budget": (int, float), "layers_every": (int,), "lease_seconds": (int, float),
    "paused": (bool,)}


class FrameworkHooks(Protocol):
    """What the probe asks of a framework's hooks (torch_hooks, tensorflow_hooks)."""

    def install(self) -> None: ...

    def remove(self) -> None: ...

    def settings(self) -> dict[str, str]: ...


@runtime_checkable
class AttributingHooks(Protocol):
    """Hooks that label layers, so that kernel time can be put on them."""

    layer_labels: list[str]
    kernels: LayerIdSource | None


def checked_options(args: object, current: SessionOptions) -> SessionOptions:
    """``current`` with ``args`` (StartArgs) applied; anything odd raises ValueError."""
    if not isinstance(args, dict):
        raise ValueError("args must be an object")
    merged: dict[str, object] = dict(current)
    for key, value in args.items():
        kinds = _OPTION_TYPES.get(key)
        # bool is an int in Python; only the switches may be one.
        if kinds is None or not isinstance(value, kinds) or (
                isinstance(value, bool) and bool not in kinds):
            raise ValueError(f"bad argument {key!r}")
        merged[key] = value
    # Each value has passed its type check above, or is current's.
    options = cast(SessionOptions, merged)
    if not 0.01 <= options["interval_seconds"] <= 3600:
        raise ValueError("interval_seconds out of range")
    if not 0 <= options["warmup_steps"] <= 1_000_000:
        raise ValueError("warmup_steps out of range")
    if not 1 <= options["max_layers"] <= 4096:
        raise ValueError("max_layers out of range")
    if not 0.0001 <= options["layers_budget"] <= 1:
        raise ValueError("layers_budget out of range")
    if not 0 <= options["layers_every"] <= MAX_SAMPLE_INTERVAL:
        raise ValueError("layers_every out of range")
    if not 0 <= options["lease_seconds"] <= MAX_LEASE_SECONDS:
        raise ValueError("lease_seconds out of range")
    return options


class Session:
    """What an attached agent asked for, and the hooks installed for it."""

    def __init__(self, connection: socket.socket, peer_pid: int, peer_uid: int,
                 options: SessionOptions) -> None:
        self.connection = connection
        self.peer_pid = peer_pid
        self.peer_uid = peer_uid
        self.interval = float(options["interval_seconds"])
        self.lease_override = float(options["lease_seconds"])  # 0: from the interval
        self.layers = bool(options["layers"])
        self.split = bool(options["split"])
        self.recorder = Recorder(warmup_steps=int(options["warmup_steps"]),
                                 max_layers=int(options["max_layers"]))
        self.recorder.split = self.split
        self.layer_sampling = (float(options["layers_budget"]), int(options["layers_every"]))
        self.set_layers(self.layers)
        self.hooks: dict[str, FrameworkHooks] = {}
        self.last_message = time.monotonic()
        self.kernels = bool(options["kernels"])  # asked for; the tracer's is off while paused
        self.paused = bool(options["paused"])
        self.tracer = KernelTracer(continuous=self.kernels, max_layers=int(options["max_layers"]))
        self.tracer.recorder = self.recorder
        if self.paused:
            self.tracer.set_continuous(False, PAUSED)
        # Made on the probe thread (Probe._handshake): its CPU from here is this session's.
        self.thread_cpu_started = time.thread_time()

    @property
    def lease_seconds(self) -> float:
        """Silence past this ends the session: the agent asked for it (tests shorten
        it), or three intervals and a second."""
        return self.lease_override or max(MIN_LEASE_SECONDS,
                                          LEASE_INTERVALS * self.interval + LEASE_MARGIN_SECONDS)

    def options(self) -> SessionOptions:
        """What this session runs with now, as ``configure`` starts from."""
        return {"interval_seconds": self.interval, "layers": self.layers, "split": self.split,
                "warmup_steps": self.recorder.warmup_steps,
                "max_layers": self.recorder.max_layers, "agent_pid": 0,
                "kernels": self.kernels,
                "layers_budget": self.layer_sampling[0],
                "layers_every": self.layer_sampling[1],
                "lease_seconds": self.lease_override, "paused": self.paused}

    def reconfigure(self, options: SessionOptions, errors: dict[str, int]) -> None:
        self.interval = float(options["interval_seconds"])
        self.lease_override = float(options["lease_seconds"])
        self.recorder.set_warmup_steps(int(options["warmup_steps"]))
        self.recorder.max_layers = int(options["max_layers"])
        sampling = (float(options["layers_budget"]), int(options["layers_every"]))
        if (bool(options["layers"]) != self.layers or sampling != self.layer_sampling
                or bool(options["split"]) != self.split):
            self.layer_sampling = sampling
            self.split = self.recorder.split = bool(options["split"])
            self.remove_hooks()
            self.set_layers(bool(options["layers"]))
            self.install_new_hooks(errors)
        if bool(options["paused"]) != self.paused:
            self.paused = bool(options["paused"])
            if self.paused:
                self.remove_hooks()
            else:
                self.recorder.resume()
                self.install_new_hooks(errors)
        self.kernels = bool(options["kernels"])
        # Paused is off: no hooks and no CUPTI, what the job runs without an agent.
        self.tracer.set_continuous(self.kernels and not self.paused,
                                   PAUSED if self.paused else SWITCHED_OFF)

    def set_layers(self, layers: bool) -> None:
        self.layers = layers
        budget, every = self.layer_sampling
        before = self.recorder.layer_sampling
        sampling = LayerSampling(budget=budget, every=every) if layers else None
        if sampling is not None and before is not None:
            sampling.cost_seconds = before.cost_seconds  # a counter: it carries on
        self.recorder.layer_sampling = sampling

    def install_new_hooks(self, errors: dict[str, int]) -> None:
        """Hook each framework once it is imported: with `run`, the agent
        arrives before the script has imported anything. None while paused."""
        if self.paused:
            return
        for module_name, hooks_module, class_name in FRAMEWORK_HOOKS:
            if module_name in self.hooks or not framework_imported(module_name):
                continue
            try:
                module = __import__(hooks_module, fromlist=[class_name])
                hooks: FrameworkHooks = getattr(module, class_name)(
                    self.recorder, layers=self.layers, split=self.split)
                self.hooks[module_name] = hooks
                if self.layers and isinstance(hooks, AttributingHooks):
                    hooks.kernels = self.tracer  # kernel time per layer, while tracing
                    self.tracer.set_layers(hooks.layer_labels)
                hooks.install()
            except Exception as error:
                errors["install"] = errors.get("install", 0) + 1
                self.recorder.hook_failed(f"install {module_name}", error)

    def remove_hooks(self) -> None:
        hooks, self.hooks = self.hooks, {}
        self.tracer.set_layers(None)
        for installed in hooks.values():
            with contextlib.suppress(Exception):
                installed.remove()

    def start_trace(self, args: object) -> TraceStarted | ErrorReply:
        """A windowed trace of the next N steps (command ``trace``, TraceArgs).
        Raises ValueError for bad arguments."""
        if not isinstance(args, dict) or set(args) - {"steps", "max_seconds"}:
            raise ValueError("bad trace arguments")
        steps, max_seconds = args.get("steps", 10), args.get("max_seconds", 600)
        if (not isinstance(steps, int) or isinstance(steps, bool)
                or not 1 <= steps <= MAX_TRACE_STEPS):
            raise ValueError("steps out of range")
        if (not isinstance(max_seconds, (int, float)) or isinstance(max_seconds, bool)
                or not 1 <= max_seconds <= 86400):
            raise ValueError("max_seconds out of range")
        error = self.tracer.start_capture(steps, float(max_seconds))
        if error:
            return {"ok": False, "error": error}
        return {"ok": True, "layers": self.layers, "frameworks": sorted(self.hooks)}

    def trace_status(self, args: object) -> TraceStatus:
        """Command ``trace_status`` (TraceStatusArgs). Raises ValueError for bad
        arguments."""
        offset = args.get("offset", 0) if isinstance(args, dict) else None
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError("bad offset")
        return self.tracer.capture_status(offset)

    def cpu_seconds(self) -> dict[str, float]:
        """The probe's own CPU in this session: the recorder's parts and the probe
        thread's (called on that thread)."""
        parts = dict(self.recorder.cpu_seconds())
        parts["thread"] = max(0.0, time.thread_time() - self.thread_cpu_started)
        return parts

    def settings(self) -> dict[str, dict[str, str]]:
        result = {}
        for module_name, hooks in self.hooks.items():
            try:
                result[module_name] = {**hooks.settings(), **process_group(module_name)}
            except Exception as error:
                self.recorder.hook_failed(f"settings {module_name}", error)
        return result

