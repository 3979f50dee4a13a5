"""The one-line live status on a terminal, and the summary printed on exit."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from dlprof_agent.model.findings.catalogue import SEVERITIES, Finding, active
from dlprof_agent.model.snapshot import Snapshot
from dlprof_agent.probe_link.samples import LayerSample, ProbeSample


@dataclass(frozen=True, slots=True)
class TreeTotals:
    """The target and its descendants, added up."""

    processes: int
    user_seconds: float
    system_seconds: float
    iowait_seconds: float
    rss_bytes: int
    threads: int
    context_switches: int
    involuntary_switches: int

    @classmethod
    def of(cls, snapshot: Snapshot) -> TreeTotals:
        ps = snapshot.processes
        return cls(
            processes=len(ps),
            user_seconds=sum(p.user_seconds for p in ps),
            system_seconds=sum(p.system_seconds for p in ps),
            iowait_seconds=sum(p.iowait_seconds for p in ps),
            rss_bytes=sum(p.rss_bytes for p in ps),
            threads=sum(p.threads for p in ps),
            context_switches=sum(p.voluntary_context_switches
                                 + p.involuntary_context_switches for p in ps),
            involuntary_switches=sum(p.involuntary_context_switches for p in ps),
        )


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def _gpu_part(snapshot: Snapshot) -> str:
    gpu = snapshot.gpu
    if gpu is None or not gpu.available:
        return "gpu n/a"
    utilizations = [d.utilization_ratio for d in gpu.devices if d.utilization_ratio is not None]
    memory = sum(p.memory_bytes or 0 for p in gpu.processes)
    mean = f"{100 * sum(utilizations) / len(utilizations):.0f}%" if utilizations else "?"
    return f"gpu {mean} mem {format_bytes(memory)}"


LIVE_TOP_LAYERS = 2


def _layer_seconds(probe: ProbeSample) -> dict[str, float]:
    return {layer.name: layer.forward_seconds + layer.backward_seconds for layer in probe.layers}


def _top_layers_part(probe: ProbeSample, previous: ProbeSample, step_seconds: float) -> str:
    """The layers that took most of the last interval's steps, as shares of them."""
    before = _layer_seconds(previous)
    spent = sorted(((seconds - before.get(name, 0.0), name)
                    for name, seconds in _layer_seconds(probe).items()), reverse=True)
    shares = [f"{name} {seconds / step_seconds:.0%}"
              for seconds, name in spent[:LIVE_TOP_LAYERS] if seconds > 0]
    return " | top " + ", ".join(shares) if shares else ""


def _probe_part(probe: ProbeSample | None, previous: ProbeSample | None) -> str:
    """Step time, samples per second and the top layers over the last interval,
    once steady."""
    if probe is None:
        return ""
    if previous is None or probe.steady_steps <= previous.steady_steps:
        warmup = dict(probe.steps).get("warmup", 0)
        return f" | steps {warmup + probe.steady_steps}" + (
            " (warm-up)" if not probe.steady_steps else "")
    steps = probe.steady_steps - previous.steady_steps
    step_seconds = (probe.step_seconds_sum - previous.step_seconds_sum) / steps
    line = f" | step {1000 * step_seconds:.1f} ms"
    samples = probe.steady_samples - previous.steady_samples
    if samples and step_seconds > 0:
        line += f" {samples / steps / step_seconds:.0f} samples/s"
    steps_seconds = probe.step_seconds_sum - previous.step_seconds_sum
    if probe.layers and steps_seconds > 0:
        line += _top_layers_part(probe, previous, steps_seconds)
    return line


def _findings_part(findings: tuple[Finding, ...]) -> str:
    raised = active(findings)
    return " | findings: " + ", ".join(f.id for f in raised) if raised else ""


def format_evidence(quantity: str, value: float) -> str:
    """One figure of a finding, in the unit its name ends with."""
    name = quantity.replace("_", " ")
    if quantity.endswith("_ratio"):
        return f"{name.removesuffix(' ratio')} {value:.0%}"
    if quantity.endswith("_bytes"):
        return f"{name.removesuffix(' bytes')} {format_bytes(value)}"
    if quantity.endswith("_bytes_per_second"):
        return f"{name.removesuffix(' bytes per second')} {format_bytes(value)}/s"
    return f"{name} {value:.3g}"


class LiveStatus:
    """Rewrites one terminal line per sample. Log records clear it first.
    ``note`` (what the agent waits for, such as the probe's start) ends the line;
    with ``notes_only`` the line shows the note alone, and nothing without one."""

    def __init__(self, stream: TextIO, *, notes_only: bool = False) -> None:
        self._stream = stream
        self._notes_only = notes_only
        self.note = ""
        self._previous: tuple[float, TreeTotals] | None = None
        self._previous_probe: ProbeSample | None = None
        self._shown = False

    def show(self, snapshot: Snapshot) -> None:
        if not snapshot.target_up:
            return
        if self._notes_only:
            if self.note:
                self._write(f"pid {snapshot.target_pid} | {self.note}")
            else:
                self.clear()
            return
        totals = TreeTotals.of(snapshot)
        previous, self._previous = self._previous, (snapshot.monotonic_seconds, totals)
        if previous is None:
            cpu = "cpu …"
        else:
            elapsed = max(snapshot.monotonic_seconds - previous[0], 1e-9)
            last = previous[1]
            user = 100 * (totals.user_seconds - last.user_seconds) / elapsed
            system = 100 * (totals.system_seconds - last.system_seconds) / elapsed
            iowait = 100 * (totals.iowait_seconds - last.iowait_seconds) / elapsed
            cpu = f"cpu usr {user:.0f}% sys {system:.0f}% io {iowait:.0f}%"
        procs = f" in {totals.processes} procs" if totals.processes > 1 else ""
        line = (f"pid {snapshot.target_pid}{procs} | {cpu} | rss "
                f"{format_bytes(totals.rss_bytes)} | {totals.threads} threads | "
                f"{_gpu_part(snapshot)}{_probe_part(snapshot.probe, self._previous_probe)}"
                f"{_findings_part(snapshot.findings)}"
                + (f" | {self.note}" if self.note else ""))
        self._previous_probe = snapshot.probe
        self._write(line)

    def _write(self, line: str) -> None:
        self._stream.write("\r\x1b[K" + line)
        self._stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._shown = False


class StatusAwareHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Clears the live line before a log record, so the two never interleave."""

    def __init__(self, stream: TextIO, status: LiveStatus | None) -> None:
        super().__init__(stream)
        self._status = status

    def emit(self, record: logging.LogRecord) -> None:
        if self._status is not None:
            self._status.clear()
        super().emit(record)


def configure_logging(status: LiveStatus | None) -> None:
    """The agent's messages, one line each on stderr, clear of the live line."""
    handler = StatusAwareHandler(sys.stderr, status)
    handler.setFormatter(logging.Formatter("dlprof-agent: %(message)s"))
    log = logging.getLogger("dlprof_agent")
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


class Summary:
    """What the agent saw between attach and exit."""

    def __init__(self) -> None:
        self._first: Snapshot | None = None
        self._last_up: Snapshot | None = None
        self._first_totals: TreeTotals | None = None
        self.peak_rss_bytes = 0
        self.peak_threads = 0
        self.peak_processes = 0
        self.peak_gpu_memory_bytes = 0
        self._gpu_utilization_sum = 0.0
        self._gpu_utilization_count = 0
        self.samples = 0
        self.last_probe: ProbeSample | None = None
        # The first and latest samples that saw steady steps: CPU per steady step
        # comes from between them, free of start-up and warm-up.
        self._steady_first: tuple[ProbeSample, TreeTotals, float] | None = None
        self._steady_last: tuple[ProbeSample, TreeTotals, float] | None = None
        # Findings raised at any point: id -> [latest raised state, seconds raised, now too]
        self.findings: dict[str, _SeenFinding] = {}
        self._last_findings_at: float | None = None

    def add(self, snapshot: Snapshot) -> None:
        self.samples += 1
        if not snapshot.target_up:
            return
        totals = TreeTotals.of(snapshot)
        if self._first is None:
            self._first, self._first_totals = snapshot, totals
        self._last_up = snapshot
        self._track_findings(snapshot)
        if snapshot.probe is not None:
            self.last_probe = snapshot.probe
            self._track_steady(snapshot.probe, totals, snapshot.monotonic_seconds)
        self.peak_rss_bytes = max(self.peak_rss_bytes,
                                  sum(p.rss_peak_bytes for p in snapshot.processes))
        self.peak_threads = max(self.peak_threads, totals.threads)
        self.peak_processes = max(self.peak_processes, totals.processes)
        if snapshot.gpu is not None and snapshot.gpu.available:
            self.peak_gpu_memory_bytes = max(
                self.peak_gpu_memory_bytes,
                sum(p.memory_bytes or 0 for p in snapshot.gpu.processes))
            for device in snapshot.gpu.devices:
                if device.utilization_ratio is not None:
                    self._gpu_utilization_sum += device.utilization_ratio
                    self._gpu_utilization_count += 1

    def _track_findings(self, snapshot: Snapshot) -> None:
        now = snapshot.monotonic_seconds
        elapsed = 0.0 if self._last_findings_at is None else now - self._last_findings_at
        self._last_findings_at = now
        raised = {f.id: f for f in active(snapshot.findings)}
        for seen in self.findings.values():
            seen.holding = seen.finding.id in raised
        for finding in raised.values():
            known = self.findings.get(finding.id)
            if known is None:
                self.findings[finding.id] = _SeenFinding(finding)
            else:
                known.finding, known.held_seconds = finding, known.held_seconds + elapsed

    def _track_steady(self, probe: ProbeSample, totals: TreeTotals, now: float) -> None:
        if not probe.steady_steps:
            return
        seen = (probe, totals, now)
        if self._steady_first is None:
            self._steady_first = seen
        if self._steady_last is None or probe.steady_steps > self._steady_last[0].steady_steps:
            self._steady_last = seen

    def steady_window(self) -> dict[str, float] | None:
        """CPU and context switches per steady step, between the first and latest
        samples that saw steady steps; None until two such samples differ."""
        if self._steady_first is None or self._steady_last is None:
            return None
        (first, start, started), (last, end, ended) = self._steady_first, self._steady_last
        steps = last.steady_steps - first.steady_steps
        if steps <= 0:
            return None
        step_seconds = last.step_seconds_sum - first.step_seconds_sum
        return {
            "steps": steps,
            "seconds": ended - started,
            "step_seconds": step_seconds / steps,
            "cpu_user_seconds_per_step": (end.user_seconds - start.user_seconds) / steps,
            "cpu_system_seconds_per_step": (end.system_seconds - start.system_seconds) / steps,
            "cpu_iowait_seconds_per_step": (end.iowait_seconds - start.iowait_seconds) / steps,
            "context_switches_per_step": (end.context_switches - start.context_switches) / steps,
            "involuntary_switches_per_step": ((end.involuntary_switches
                                               - start.involuntary_switches) / steps),
        }

    def as_dict(self, target_pid: int) -> dict[str, Any]:
        """What `render` shows, for scripts: whole-watch figures, and per steady step."""
        first, last, first_totals = self._first, self._last_up, self._first_totals
        result: dict[str, Any] = {"pid": target_pid, "samples": self.samples,
                                  "peak_rss_bytes": self.peak_rss_bytes,
                                  "peak_threads": self.peak_threads,
                                  "peak_processes": self.peak_processes,
                                  "peak_gpu_memory_bytes": self.peak_gpu_memory_bytes or None,
                                  "gpu_mean_utilization": (
                                      self._gpu_utilization_sum / self._gpu_utilization_count
                                      if self._gpu_utilization_count else None)}
        if first is not None and last is not None and first_totals is not None:
            totals = TreeTotals.of(last)
            result.update(
                watched_seconds=last.monotonic_seconds - first.monotonic_seconds,
                cpu_user_seconds=totals.user_seconds - first_totals.user_seconds,
                cpu_system_seconds=totals.system_seconds - first_totals.system_seconds,
                cpu_iowait_seconds=totals.iowait_seconds - first_totals.iowait_seconds,
                context_switches=totals.context_switches - first_totals.context_switches,
                involuntary_switches=(totals.involuntary_switches
                                      - first_totals.involuntary_switches))
        probe = self.last_probe
        if probe is not None:
            result["probe"] = {
                "step_source": probe.step_source,
                "steady_steps": probe.steady_steps,
                "warmup_steps": dict(probe.steps).get("warmup", 0),
                "mean_step_seconds": (probe.step_seconds_sum / probe.steady_steps
                                      if probe.steady_steps else None),
                "samples_per_second": (probe.steady_samples / probe.step_seconds_sum
                                       if probe.steady_samples and probe.step_seconds_sum
                                       else None),
                "phase_seconds": dict(probe.phase_seconds),
                "phase_split": probe.phase_split,
                "layers": {layer.name: {"forward_seconds": layer.forward_seconds,
                                        "backward_seconds": layer.backward_seconds}
                           for layer in probe.layers},
            }
        result["steady"] = self.steady_window()
        result["findings"] = [
            {"finding": seen.finding.id, "severity": seen.finding.severity,
             "held_seconds": seen.held_seconds, "holding_at_end": seen.holding,
             "evidence": dict(seen.finding.evidence), "advice": seen.finding.kind.advice}
            for seen in self._seen_in_order()]
        return result

    def _seen_in_order(self) -> list[_SeenFinding]:
        return sorted(self.findings.values(), key=lambda seen: (
            -SEVERITIES.index(seen.finding.severity), seen.finding.id))

    def render(self, target_pid: int, *, target_exited: bool) -> str:
        lines = [f"dlprof-agent summary for pid {target_pid}"
                 + (" (the process exited)" if target_exited else "")]
        first, last, first_totals = self._first, self._last_up, self._first_totals
        if first is None or last is None or first_totals is None:
            return lines[0] + ": no samples taken"
        elapsed = last.monotonic_seconds - first.monotonic_seconds
        totals = TreeTotals.of(last)
        lines.append(f"  watched      {elapsed:.1f} s, {self.samples} samples")
        if elapsed > 0:
            def cores(now: float, then: float) -> str:
                return f"{(now - then) / elapsed:.2f}"
            lines.append(
                "  cpu cores    user " + cores(totals.user_seconds, first_totals.user_seconds)
                + "  system " + cores(totals.system_seconds, first_totals.system_seconds)
                + "  iowait " + cores(totals.iowait_seconds, first_totals.iowait_seconds))
            switches = (totals.context_switches - first_totals.context_switches) / elapsed
            lines.append(f"  ctx switches {switches:.0f}/s")
        lines.append(f"  memory       peak rss {format_bytes(self.peak_rss_bytes)}"
                     f"  (now {format_bytes(totals.rss_bytes)})")
        lines.append(f"  threads      peak {self.peak_threads}"
                     + (f" in {self.peak_processes} processes" if self.peak_processes > 1
                        else ""))
        if self._gpu_utilization_count:
            mean = 100 * self._gpu_utilization_sum / self._gpu_utilization_count
            lines.append(f"  gpu          mean utilization {mean:.0f}%, peak process memory "
                         f"{format_bytes(self.peak_gpu_memory_bytes)}")
        else:
            lines.append("  gpu          not available")
        lines.extend(_probe_summary(self.last_probe))
        lines.extend(self._findings_summary())
        return "\n".join(lines)

    def _findings_summary(self) -> list[str]:
        seen = self._seen_in_order()
        if not seen:
            return ["  findings     none"]
        lines = []
        for item in seen:
            finding = item.finding
            when = "holding at the end" if item.holding else "cleared"
            lines.append(f"  {finding.severity:<12} {finding.id} (held {item.held_seconds:.0f} s, "
                         f"{when}): {finding.kind.summary}")
            lines.append("               evidence: " + ", ".join(
                format_evidence(q, v) for q, v in finding.evidence))
            lines.append(f"               try: {finding.kind.advice}")
        return lines


@dataclass
class _SeenFinding:
    finding: Finding  # as last seen raised: its evidence then
    held_seconds: float = 0.0
    holding: bool = True


TOP_LAYERS = 5


def _probe_summary(probe: ProbeSample | None) -> list[str]:
    if probe is None:
        return ["  steps        no in-process probe"]
    steps = probe.steady_steps
    warmup = dict(probe.steps).get("warmup", 0)
    if not steps:
        return [f"  steps        {warmup} warm-up steps, no steady ones yet"]
    mean = probe.step_seconds_sum / steps
    line = f"  steps        {steps} steady (+{warmup} warm-up), mean {1000 * mean:.1f} ms"
    if probe.steady_samples:
        line += f", {probe.steady_samples / probe.step_seconds_sum:.0f} samples/s"
    lines = [line]
    if probe.step_seconds_sum > 0 and probe.phase_seconds:
        # The phases sum to the step time; a split that is not one says why first.
        why = (f"{probe.phase_split}: " if probe.phase_split not in (None, "split")
               else "")
        lines.append("  step split   " + why + "  ".join(
            f"{phase} {seconds / probe.step_seconds_sum:.0%}"
            for phase, seconds in probe.phase_seconds))
    layers = sorted(probe.layers, key=lambda layer: -(layer.forward_seconds
                                                        + layer.backward_seconds))
    if layers and probe.step_seconds_sum > 0:
        def share(layer: LayerSample) -> str:
            seconds = layer.forward_seconds + layer.backward_seconds
            return f"{layer.name} {seconds / probe.step_seconds_sum:.0%}"
        lines.append("  top layers   " + "  ".join(map(share, layers[:TOP_LAYERS])))
    return lines
