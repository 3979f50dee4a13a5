"""The probe's wire format: each command's request and reply, written down once.

Both ends use these types: the probe builds its replies as them (the connection
handlers, ``Recorder.snapshot()``, the kernel tracer's tables), and the agent
reads them (``probe_link/samples.py``), where every value is still checked:
what arrives on the socket may come from anything.

A frame holds one JSON object (``protocol.py``). A row is a JSON array of fixed
positions, a list at both ends: its alias (``LayerTimes`` and friends) names the
positions, and the decoder unpacks it by position and checks each value. Its
items are ``Any``: a tuple type would name each position's type, but the rows
are lists (callers compare them with lists), and a list type holds one item
type. Keys that only some probes send (older ones, or only in some states) sit
in the ``total=False`` part of a type.

The standard library only: this module loads inside the training process.
"""

from __future__ import annotations

from typing import Any, TypedDict

# A frame's object as decoded, before anything in it is checked.
Frame = dict[str, object]

# Values a reply carries that the agent's rules read: a phase's name and a split's
# state. Here and not in the recorder, whose import the agent does without.
EXCHANGE_PHASE = "exchange"  # waiting for the other ranks in collectives
# A torch.compile'd function called outside the model's forward (a compiled train
# step): its forward, and its backward where it runs inside.
COMPILED_PHASE = "compiled"
SPLIT = "split"
# The row that rows past a limit fold into: layers past max_layers, kernels past
# the tracer's cap (per device), layer GPU time of layers past max_layers.
OTHER = "other"
# GPUs a reply may name: the probe counts a higher device index as the last one,
# and the agent refuses a reply with more.
MAX_DEVICES = 64
# Steps a session leaves out of its steady figures when the agent names none
# (StartArgs.warmup_steps); the agent's --warmup-steps defaults to the same.
DEFAULT_WARMUP_STEPS = 10


# --- requests: agent -> probe --------------------------------------------------------


class _RequestBase(TypedDict):
    command: str  # one of protocol.COMMANDS


class Request(_RequestBase, total=False):
    # StartArgs for start and configure, TraceArgs, TraceStatusArgs; none otherwise.
    args: object


class StartArgs(TypedDict, total=False):
    """``start`` and ``configure``: what the agent asks for. A key left out keeps
    its default (start) or its current value (configure)."""

    interval_seconds: float
    layers: bool
    split: bool  # the step's phases; sent only when False, as kernels
    warmup_steps: int
    max_layers: int
    agent_pid: int
    kernels: bool  # sent only when False: an older probe refuses keys it does not know
    layers_budget: float  # fraction of step time layer timing may add
    layers_every: int  # time one step in this many; 0: as the budget allows
    lease_seconds: float  # sent only when set; 0: three intervals and a second, at least 2 s
    # configure only: True takes every hook out and keeps the totals; False puts
    # them back (the overhead benchmark's paired blocks, in one session)
    paused: bool


class SessionOptions(TypedDict):
    """StartArgs once checked and merged with the defaults: every key is there."""

    interval_seconds: float
    layers: bool
    split: bool
    warmup_steps: int
    max_layers: int
    agent_pid: int
    kernels: bool
    layers_budget: float
    layers_every: int
    lease_seconds: float
    paused: bool


class TraceArgs(TypedDict, total=False):
    steps: int  # default 10
    max_seconds: float  # default 600


class TraceStatusArgs(TypedDict, total=False):
    offset: int  # characters of the payload already taken


# --- replies: probe -> agent ---------------------------------------------------------


class _ErrorBase(TypedDict):
    ok: bool  # False
    error: str


class ErrorReply(_ErrorBase, total=False):
    agent_pid: int  # with "busy": the attached agent, when the asker may know it


class OkReply(TypedDict):
    """``configure`` and ``stop``."""

    ok: bool  # True


class HelloReply(TypedDict):
    """``start``, accepted."""

    ok: bool
    version: int
    pid: int
    python: str
    persistent: bool
    frameworks: list[str]
    capabilities: list[str]


# [name, forward seconds, forward calls, backward seconds, backward calls]
LayerTimes = list[Any]


class _RecorderSnapshotBase(TypedDict):
    step_source: str
    steps: dict[str, int]  # phase (warmup, steady) -> steps
    samples: dict[str, int]
    step_buckets: list[float]  # upper bounds, seconds; +Inf implied
    step_bucket_counts: list[int]  # per bucket, not cumulative; one more than the bounds
    step_seconds_sum: float
    last_step_seconds: float | None
    phase_seconds: dict[str, float]
    layers: list[LayerTimes]
    hook_errors: int
    hook_error_kinds: dict[str, str]  # where -> the first error there


class RecorderSnapshot(_RecorderSnapshotBase, total=False):
    layer_sampled_steps: int  # only when layer timing is duty-cycled
    # The probe's own CPU: "hooks" (its code on the job's threads), "layers" (what
    # timed steps added, with layer timing), "thread" (the probe's thread).
    cpu_seconds: dict[str, float]
    # Once a steady step closed: "split", or why its phases are not (recorder.py).
    phase_split: str


KernelTimes = list[Any]  # [short kernel name, device, launches, seconds]
DurationCounts = list[Any]  # [device, per-bucket counts, seconds]
CopyTotals = list[Any]  # [device, direction, bytes, seconds]
LayerGpuTimes = list[Any]  # [layer, phase, GPU seconds]


class KernelTotals(TypedDict):
    """What the tracer has folded in since it first started (kernel_totals.py)."""

    kernels: list[KernelTimes]
    duration_buckets: list[float]  # upper bounds, seconds; +Inf implied
    durations: list[DurationCounts]
    memcpy: list[CopyTotals]
    layers: list[LayerGpuTimes]
    overhead_seconds: float
    records: int
    incomplete_records: int
    undecoded_bytes: int


class RecordClockState(TypedDict):
    """Which clock CUPTI's records count in (probe/record_clock.py)."""

    clock: str  # native (CUPTI's ns), foreign (another client's), unknown
    measured_by: str  # rate (cuptiGetTimestamp's at open), records (their ends), ""
    ticks_per_ns: float


class _KernelStateBase(TypedDict):
    state: str  # active, busy, unavailable
    reason: str
    errors: int


class KernelSnapshot(_KernelStateBase, total=False):
    """The tracer's state; once it has traced, its totals too (KernelTotals' keys)."""

    since: float  # Unix time the state last changed; older probes do not say

    kernels: list[KernelTimes]
    duration_buckets: list[float]
    durations: list[DurationCounts]
    memcpy: list[CopyTotals]
    layers: list[LayerGpuTimes]
    overhead_seconds: float
    records: int
    incomplete_records: int
    undecoded_bytes: int
    dropped_records: int
    devices: dict[str, str]  # CUDA ordinal -> GPU UUID
    record_clock: RecordClockState  # absent from older probes
    unmeasured_batches: int  # dropped: their clock was never measured


class _SnapshotReplyBase(TypedDict):
    ok: bool
    probe: RecorderSnapshot


class SnapshotReply(_SnapshotReplyBase, total=False):
    settings: dict[str, dict[str, str]]  # framework -> its settings
    dropped: dict[str, int]  # reason -> messages the probe dropped
    kernels: KernelSnapshot  # absent from probes older than kernel tracing


class TraceStarted(TypedDict):
    """``trace``, accepted."""

    ok: bool
    layers: bool  # layer ranges will be in the payload
    frameworks: list[str]


class _TraceStatusBase(TypedDict):
    ok: bool


class TraceStatus(_TraceStatusBase, total=False):
    """``trace_status``: the capture's progress; only ``error`` when no trace was
    asked for."""

    phase: str  # waiting, recording, collecting, done, failed
    steps: int  # steps recorded so far
    wanted: int
    error: str  # when failed, or no trace was asked for
    size: int  # when done: the payload's length in characters
    data: str  # when done: the payload's characters from the asked offset, a chunk


# --- the trace payload: TraceStatus's data, once joined and parsed ---------------------


class KernelColumns(TypedDict):
    """One list per field, one position per kernel or memset; times in ns, CUPTI's clock."""

    start: list[int]
    end: list[int]
    device: list[int]
    stream: list[int]
    correlation: list[int]
    name: list[int]  # full-name id: index into full_names and full_to_name
    layer: list[int]  # index into labels, or -1
    phase: list[int]  # 0 forward, 1 backward


class CopyColumns(TypedDict):
    start: list[int]
    end: list[int]
    device: list[int]
    stream: list[int]
    kind: list[str]  # direction: h2d, d2h, ...
    bytes: list[int]


# [label, backward (0 or 1), start ns, end ns, host thread id]
LayerRange = list[Any]


class TracePayload(TypedDict):
    steps: list[int]  # step boundaries, ns
    kernels: KernelColumns
    names: list[str]  # short names
    full_names: list[str]
    full_to_name: list[int]  # full-name id -> short-name id
    memcpy: CopyColumns
    labels: list[str]  # layer labels
    layers: list[LayerRange]
    devices: dict[str, str]  # CUDA ordinal -> GPU UUID
    truncated: bool
