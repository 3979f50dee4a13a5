"""Typed samples of what a probe measured, decoded from its snapshot reply
(``probe/messages.py``) by a bounded, validating decoder: the reply comes from
whatever answers on the socket, so every value is checked and anything a probe
of ours would not send is refused whole (ProtocolError)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar, cast

from dlprof_agent.collectors.labels import cut_label
from dlprof_agent.errors import ProtocolError
from dlprof_agent.probe.messages import (
    MAX_DEVICES,
    KernelSnapshot,
    RecorderSnapshot,
    SnapshotReply,
)
from dlprof_agent.probe_link.reply_rows import (
    MAX_NAME_CHARS,
    Trimmed,
    family_budgets,
    layer_series,
    trim_kernels,
    trim_layer_gpu,
    trim_layers,
)

# What a reply may carry. A real probe stays far inside these (at most max_layers
# names and "other", 200 kernels and "other" per device); anything past them is
# not a probe of ours, and is refused whole rather than exported in part. Also
# MAX_NAME_CHARS (reply_rows.py) and MAX_DEVICES (the probe's messages.py).
MAX_LAYER_ROWS = 4096 + 1  # the probe's largest max_layers, and "other"
MAX_KERNEL_ROWS = MAX_DEVICES * 201  # 200 kernels and "other" per device
MAX_BUCKETS = 64
MAX_ENTRIES = 64  # the keys of a small map: phases, dropped reasons, settings
_T = TypeVar("_T")


RECORD_CLOCKS = ("", "native", "foreign", "unknown")
RECORD_CLOCK_MEASUREMENTS = ("", "rate", "records")


def _malformed(what: str) -> ProtocolError:
    return ProtocolError("malformed", f"the reply's {what} is not what a probe sends")


def _text(value: object, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _malformed(what)
    text = str(value)
    if len(text) > MAX_NAME_CHARS:
        raise ProtocolError("oversized", f"a {what} of {len(text)} characters")
    return text


def _label(value: object, what: str) -> str:
    """A layer or kernel name, as a label value (``cut_label``)."""
    return cut_label(_text(value, what))


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise _malformed(what)
    return value


def _seconds(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _malformed(what)
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise _malformed(what)
    return seconds


def _list(value: object, limit: int, what: str) -> list[object]:
    if not isinstance(value, list):
        raise _malformed(what)
    if len(value) > limit:
        raise ProtocolError("oversized", f"{len(value)} {what}, at most {limit}")
    return value


def _rows(value: object, limit: int, width: int, what: str) -> list[list[object]]:
    rows = _list(value, limit, what)
    if not all(isinstance(row, list) and len(row) == width for row in rows):
        raise _malformed(what)
    return cast(list[list[object]], rows)


def _map(value: object, what: str, limit: int = MAX_ENTRIES) -> dict[str, object]:
    if not isinstance(value, dict):
        raise _malformed(what)
    if len(value) > limit:
        raise ProtocolError("oversized", f"{len(value)} {what}, at most {limit}")
    return value


def _counts(value: object, what: str) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((_text(k, what), _count(v, what)) for k, v in _map(value, what).items()))


def _buckets(bounds: object, counts: object, what: str
             ) -> tuple[tuple[float, ...], tuple[int, ...]]:
    upper = tuple(_seconds(b, what) for b in _list(bounds, MAX_BUCKETS, what))
    per_bucket = tuple(_count(c, what) for c in _list(counts, MAX_BUCKETS + 1, what))
    if len(per_bucket) != len(upper) + 1 or list(upper) != sorted(upper):
        raise _malformed(what)
    return upper, per_bucket


def _kernel_snapshot(value: object) -> KernelSnapshot:
    """A map, typed for its keys only: each value is checked as it is read."""
    return cast(KernelSnapshot, _map(value, "kernels", 32))


def parse_reply(parse: Callable[[], _T]) -> _T:
    """``parse()``, with any way a reply can be wrong turned into a ProtocolError:
    the agent's boundary with whatever answers on the socket."""
    try:
        return parse()
    except ProtocolError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError
            ) as error:
        raise ProtocolError("malformed", f"unexpected reply ({type(error).__name__})"
                            ) from None


@dataclass(frozen=True, slots=True)
class LayerSample:
    name: str
    forward_seconds: float
    forward_calls: int
    backward_seconds: float
    backward_calls: int


@dataclass(frozen=True, slots=True)
class KernelRow:
    """One kernel (short name, or ``other``) on one CUDA device."""

    kernel: str
    device: int  # CUDA device ordinal, as the job sees it
    launches: int
    seconds: float


# NCCL's kernels, as profilers name them: ncclDevKernel_AllReduce_Sum_f32_RING_LL and
# ncclDevKernel_Generic (2.19 on), ncclKernel_SendRecv_RING (2.13),
# ncclAllReduceRingLLKernel_sum (older; NVIDIA/nccl issues 2196, 739, 536). One kernel
# may run several operations, so the name tells NCCL from the rest, not which call.
COLLECTIVE_KERNELS = re.compile(r"nccl", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class KernelDurations:
    device: int
    bucket_counts: tuple[int, ...]  # per bucket, not cumulative; one more than the bounds
    seconds_sum: float


@dataclass(frozen=True, slots=True)
class MemcpyRow:
    device: int
    kind: str  # h2d, d2h, d2d, p2p, h2h, other
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class LayerGpuRow:
    layer: str
    phase: str  # forward or backward
    seconds: float


@dataclass(frozen=True, slots=True)
class KernelSample:
    """The probe's CUPTI tracer: its state, and totals since the agent attached."""

    state: str  # active, busy or unavailable
    reason: str  # why busy or unavailable; "" when active
    since: float = 0.0  # Unix time the state last changed; 0 from probes that do not say
    kernels: tuple[KernelRow, ...] = ()
    duration_bucket_bounds: tuple[float, ...] = ()  # upper bounds, seconds; +Inf implied
    durations: tuple[KernelDurations, ...] = ()
    memcpy: tuple[MemcpyRow, ...] = ()
    layers: tuple[LayerGpuRow, ...] = ()
    overhead_seconds: float = 0.0
    dropped_records: int = 0
    devices: tuple[tuple[int, str], ...] = ()  # (CUDA ordinal, GPU UUID)
    record_clock: str = ""  # native, foreign, unknown; "" from probes that do not say
    record_clock_measured_by: str = ""  # rate, records, ""
    record_ticks_per_ns: float = 0.0
    unmeasured_batches: int = 0  # dropped: their clock was never measured
    traced: bool = False  # the tracer has run at some point: its counters are real

    def collective_seconds(self) -> float | None:
        """GPU time in collective (NCCL) kernels since the tracer started; None when
        the job ran none, or none among the kernels kept by name."""
        rows = [row.seconds for row in self.kernels if COLLECTIVE_KERNELS.search(row.kernel)]
        return sum(rows) if rows else None

    @classmethod
    def from_reply(cls, kernels: Mapping[str, object], *, layers: bool = True
                   ) -> KernelSample:
        """Raises ProtocolError for anything a probe would not send."""
        return parse_reply(lambda: cls._parse(_kernel_snapshot(kernels), layers,
                                              (None, None))[0])

    @classmethod
    def _parse(cls, kernels: KernelSnapshot, layers: bool,
               budgets: tuple[int | None, int | None]) -> tuple[KernelSample, Trimmed, Trimmed]:
        """The sample, with its kernel and layer GPU rows as ``trim_*`` cut them
        to ``budgets`` (series; None: all kept)."""
        traced = "kernels" in kernels
        bounds = tuple(_seconds(b, "duration bucket") for b in _list(
            kernels.get("duration_buckets", []), MAX_BUCKETS, "duration buckets"))
        durations = []
        for d, counts, total in _rows(kernels.get("durations", []), MAX_DEVICES, 3,
                                      "kernel durations"):
            _, per_bucket = _buckets(list(bounds), counts, "kernel duration buckets")
            durations.append(KernelDurations(_count(d, "device"), per_bucket,
                                             _seconds(total, "kernel seconds")))
        devices = _map(kernels.get("devices", {}), "devices", MAX_DEVICES)
        layer_rows = trim_layer_gpu(_list(kernels.get("layers", []), 2 * MAX_LAYER_ROWS,
                                          "layer GPU rows"), budgets[1] if layers else None)
        kernel_rows = trim_kernels(_list(kernels.get("kernels", []), MAX_KERNEL_ROWS,
                                         "kernel rows"), budgets[0])
        clock = _map(kernels.get("record_clock", {}), "record clock", 3)
        clock_name = _text(clock.get("clock", ""), "record clock")
        measured_by = _text(clock.get("measured_by", ""), "record clock measurement")
        if clock_name not in RECORD_CLOCKS or measured_by not in RECORD_CLOCK_MEASUREMENTS:
            raise _malformed("record clock")  # label values: only those a probe sends
        return cls(
            state=_text(kernels["state"], "kernel state"),
            reason=_text(kernels.get("reason", ""), "kernel state reason"),
            since=_seconds(kernels.get("since", 0.0), "state since"),
            kernels=tuple(KernelRow(_label(k, "kernel name"), _count(d, "device"),
                                    _count(n, "launches"), _seconds(t, "kernel seconds"))
                          for k, d, n, t in kernel_rows.rows),
            duration_bucket_bounds=bounds,
            durations=tuple(durations),
            memcpy=tuple(MemcpyRow(_count(d, "device"), _text(k, "copy kind"),
                                   _count(b, "bytes"), _seconds(t, "copy seconds"))
                         for d, k, b, t in _rows(kernels.get("memcpy", []),
                                                 MAX_DEVICES * 8, 4, "copy rows")),
            layers=tuple(LayerGpuRow(_label(n, "layer name"), _text(p, "phase"),
                                     _seconds(t, "layer GPU seconds"))
                         for n, p, t in layer_rows.rows) if layers else (),
            overhead_seconds=_seconds(kernels.get("overhead_seconds", 0.0), "overhead"),
            dropped_records=_count(kernels.get("dropped_records", 0), "dropped records"),
            record_clock=clock_name,
            record_clock_measured_by=measured_by,
            record_ticks_per_ns=_seconds(clock.get("ticks_per_ns", 0.0), "ticks per ns"),
            unmeasured_batches=_count(kernels.get("unmeasured_batches", 0),
                                      "unmeasured batches"),
            devices=tuple(sorted((int(_text(d, "device")), _text(u, "GPU UUID"))
                                 for d, u in devices.items())),
            traced=traced), kernel_rows, layer_rows


@dataclass(frozen=True, slots=True)
class ProbeSample:
    """Totals since the probe was started by this agent."""

    pid: int
    step_source: str
    steps: tuple[tuple[str, int], ...]  # (phase, count), phase warmup or steady
    samples: tuple[tuple[str, int], ...]
    step_bucket_bounds: tuple[float, ...]  # upper bounds, seconds; +Inf implied
    step_bucket_counts: tuple[int, ...]  # per bucket, not cumulative; one more than bounds
    step_seconds_sum: float
    last_step_seconds: float | None
    phase_seconds: tuple[tuple[str, float], ...]
    layers: tuple[LayerSample, ...]
    hook_errors: int
    dropped_messages: tuple[tuple[str, int], ...]  # (reason, count)
    settings: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]  # per framework
    kernels: KernelSample | None = None  # None: a probe older than kernel tracing
    layer_sampled_steps: int | None = None  # steps whose layers were timed; None: not told
    series_folded: int = 0  # series the agent's budget folded into "other" (series_budget)
    # "split", or why the latest steady step's phases are not (e.g. "backward not
    # seen"); None: no steady step yet, or a probe older than the field.
    phase_split: str | None = None
    # About what its layer, kernel and layer GPU rows took in the reply (names and
    # numbers), kept or not: what reading the reply cost (reply_pacing).
    reply_row_bytes: int = 0
    # Replies of this probe dropped undecoded so far, their size past the agent's
    # byte budget per pass (reply_pacing); this sample stood for them.
    replies_held: int = 0
    # The probe's own CPU seconds by part (hooks, layers, thread); () from a probe
    # older than the field.
    cpu_seconds: tuple[tuple[str, float], ...] = ()

    @property
    def steady_steps(self) -> int:
        return dict(self.steps).get("steady", 0)

    @property
    def steady_samples(self) -> int:
        return dict(self.samples).get("steady", 0)

    @classmethod
    def from_reply(cls, pid: int, reply: Mapping[str, object], *, layers: bool = True,
                   max_series: int | None = None) -> ProbeSample:
        """Raises ProtocolError for anything a probe would not send. Without
        ``layers`` (the agent did not ask for them), layer rows are dropped.
        With ``max_series`` (the target's series budget), each family's rows past
        what that budget could keep are folded into ``other`` before they are
        built (reply_rows), and counted in ``series_folded``."""
        # Typed for its keys only: each value is checked as it is read.
        return parse_reply(lambda: cls._parse(pid, cast(SnapshotReply, reply), layers,
                                              max_series))

    @classmethod
    def _parse(cls, pid: int, reply: SnapshotReply, layers: bool, max_series: int | None
               ) -> ProbeSample:
        probe = cast(RecorderSnapshot, _map(reply["probe"], "probe", 32))
        bounds, counts = _buckets(probe["step_buckets"], probe["step_bucket_counts"],
                                  "step buckets")
        last = probe["last_step_seconds"]
        settings = _map(reply.get("settings", {}), "settings", 8)
        kernels = reply.get("kernels")
        # Checked whether asked for or not: a probe not asked for layers sends none.
        raw_layers = _list(probe["layers"], MAX_LAYER_ROWS, "layers")
        kernel_map = _kernel_snapshot(kernels) if isinstance(kernels, dict) else None
        raw_kernels, raw_layer_gpu = ((kernel_map.get("kernels", []), kernel_map.get("layers", []))
                                      if kernel_map is not None else ([], []))
        budgets = family_budgets(max_series, (
            layer_series(raw_layers) if layers else 0,
            2 * len(raw_kernels) if isinstance(raw_kernels, list) else 0,
            len(raw_layer_gpu) if layers and isinstance(raw_layer_gpu, list) else 0))
        layer_rows = trim_layers(raw_layers, budgets[0] if layers else None)
        kernel_sample: KernelSample | None = None
        trimmed = [layer_rows]
        if kernel_map is not None:
            kernel_sample, kernel_rows, layer_gpu_rows = KernelSample._parse(
                kernel_map, layers, (budgets[1], budgets[2]))
            trimmed += [kernel_rows, layer_gpu_rows]
        return cls(
            pid=pid,
            step_source=_text(probe["step_source"], "step source"),
            steps=_counts(probe["steps"], "steps"),
            samples=_counts(probe["samples"], "samples"),
            step_bucket_bounds=bounds,
            step_bucket_counts=counts,
            step_seconds_sum=_seconds(probe["step_seconds_sum"], "step seconds"),
            last_step_seconds=None if last is None else _seconds(last, "last step"),
            phase_seconds=tuple(sorted((_text(k, "phase"), _seconds(v, "phase seconds"))
                                       for k, v in _map(probe["phase_seconds"],
                                                        "phases").items())),
            layers=tuple(LayerSample(_label(n, "layer name"), _seconds(fs, "layer seconds"),
                                     _count(fc, "layer calls"), _seconds(bs, "layer seconds"),
                                     _count(bc, "layer calls"))
                         for n, fs, fc, bs, bc in layer_rows.rows) if layers else (),
            layer_sampled_steps=(_count(probe["layer_sampled_steps"], "layer sampled steps")
                                 if "layer_sampled_steps" in probe else None),
            phase_split=(_text(probe["phase_split"], "phase split")
                         if "phase_split" in probe else None),
            hook_errors=_count(probe["hook_errors"], "hook errors"),
            cpu_seconds=tuple(sorted((_text(k, "probe CPU part"), _seconds(v, "probe CPU"))
                                     for k, v in _map(probe.get("cpu_seconds", {}),
                                                      "probe CPU", 8).items())),
            dropped_messages=_counts(reply.get("dropped", {}), "dropped messages"),
            settings=tuple(sorted(
                (_text(framework, "framework"),
                 tuple(sorted((_text(k, "setting"), _text(v, "setting"))
                              for k, v in _map(values, "settings").items())))
                for framework, values in settings.items())),
            kernels=kernel_sample,
            series_folded=sum(rows.folded_series for rows in trimmed),
            reply_row_bytes=sum(rows.row_bytes for rows in trimmed),
        )
