"""Findings: where the job's time goes and what to change, concluded from what the
agent already measures, the way the papers concluded by hand.

Each rule is a pure function of a short window of recent samples. It answers
None when the job gives it nothing to judge (no probe, no GPU, no steps yet),
else whether its cause holds now, with the figures that say so. A finding is
raised once its cause has held for ``RAISE_AFTER_SECONDS`` and cleared once it
has been gone for ``CLEAR_AFTER_SECONDS``, so one odd sample neither raises nor
clears one. Everything runs on the agent's sampling clock; scrapes only render
the result. docs/findings.md lists the rules with their sources.
"""

from __future__ import annotations

import re
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dlprof_agent.collectors.gpu_samples import GpuSample
from dlprof_agent.collectors.host import HostSample
from dlprof_agent.collectors.limits import LimitsSample
from dlprof_agent.collectors.probe_samples import ProbeSample

if TYPE_CHECKING:
    from dlprof_agent.agent.sampler import AgentSelfSample, Snapshot

SEVERITIES = ("info", "warning", "critical")

# ---- Timing ------------------------------------------------------------------------
# Rates come from the samples of the last WINDOW_SECONDS: long enough to span
# several steps of a typical job and several scheduler periods, short enough that
# a finding follows a change of setting within seconds.
WINDOW_SECONDS = 3.0
# A window shorter than this says too little (the first samples after attach).
MIN_WINDOW_SECONDS = 1.5
# A cause must hold on every pass for this long before it is reported, and be
# gone for twice that before the finding clears: a single slow step, a garbage
# collection or a neighbour's burst must not make findings flicker.
RAISE_AFTER_SECONDS = 3.0
CLEAR_AFTER_SECONDS = 6.0
# Step-based rules want at least this many steady steps in the window, so that
# the step split is an average and not one step's accident.
MIN_WINDOW_STEPS = 3

# ---- Thresholds ----------------------------------------------------------------------
# Oversubscription. Wu et al. (Table XII) and Shi et al. (Table 7) saw step time
# and the system share rise once threads exceed the cores. A job's runnable
# threads (state R: running or waiting for a CPU) averaged over the window may
# exceed its allowed CPUs by a little (a thread just woken); 1.5x, and at least
# one whole thread more, means threads queue for CPUs all the time.
RUNNABLE_PER_ALLOWED_CPU = 1.5
# Threads that queue are preempted every scheduler slice (a few ms): hundreds of
# involuntary switches per CPU-second, where a thread alone on its core sees a
# handful. The system share above 20% is the dashboards' amber line.
INVOLUNTARY_PER_CPU_SECOND = 100.0
SYSTEM_SHARE = 0.2
# CPU contention from outside the job: its runnable threads get less than half
# the CPU they could use while the host's CPUs are at least 90% busy. The job is
# not at fault; its neighbours (or the hypervisor: steal) take the CPUs, and its
# step time says more about them than about the job.
CONTENTION_SHARE = 0.5
HOST_BUSY_SHARE = 0.9
# Input-bound. With layer timing, "other" is the step time no hook saw: data
# loading, the loss and the loop's Python. The loss and the loop are a few per
# cent of a step; half the step there is time spent waiting for data.
OTHER_SHARE = 0.5
# Without layer timing: a CPU job whose process tree keeps less than half a core
# busy while it steps, with its threads mostly asleep, is waiting, not computing.
# (Threads that are runnable but get little CPU are starved by neighbours instead.)
WAITING_CORES = 0.5
WAITING_RUNNABLE_THREADS = 0.5
# GPU idle. NVML's utilization below half (the dashboards' red band) means the
# GPU waits more than it computes.
LOW_GPU_UTILIZATION = 0.5
# Launch-bound: the process that launches kernels keeps a whole core busy while
# the GPU idles, so the host cannot launch fast enough.
LAUNCH_BUSY_CORES = 0.9
# Layout. Kim et al. (§IV-B) gained ~15% by removing NHWC/NCHW transposes; on the
# H100 run of ResNet-50 in NCHW they were 12% of GPU time. 5% is worth a setting.
LAYOUT_SHARE = 0.05
# Autotuning. Kim et al. (§IV-V) measured up to 2x in convolutions from choosing
# the algorithm by benchmark; at 15% of GPU time in convolutions (with the layout
# conversions cuDNN runs around them) that is at least 7% of the step.
CONVOLUTION_SHARE = 0.15
# Mixed precision roughly halves GEMM and convolution time on tensor cores and the
# bytes every other kernel moves; where GEMMs and convolutions are 20% of GPU time
# it is worth trying.
MATMUL_SHARE = 0.2
# Memory. The OOM killer ends the job at the limit; at 90% one larger batch or a
# longer sequence is enough (Liu et al. §4.3, Wu et al. §4.7).
MEMORY_NEAR_LIMIT = 0.9
# Memory stalls: sustained swap-in, the kernel's pressure stall share, or iowait
# (Wu et al. §4.7 saw memory at its limit show as %iowait).
SWAP_IN_BYTES_PER_SECOND = 1 << 20
MEMORY_STALL_SHARE = 0.1
IOWAIT_SHARE = 0.1
MEMORY_STALL_LIMIT_SHARE = 0.8  # iowait counts as a memory stall only this close to the limit
GPU_MEMORY_NEAR_TOTAL = 0.95
# Gradient exchange. Kim et al. (§VI) measured 45 ms of gradient transfer against
# 200 ms of compute for AlexNet over PCIe: at a fifth of GPU time the exchange
# bounds scaling; overlap it with backward or compress it.
EXCHANGE_SHARE = 0.2
# The agent's own cost. Its design budget is a few per cent of one core; above
# 10% it competes with the job, and CUPTI above 3% of wall time slows the GPU work.
AGENT_CORES = 0.1
CUPTI_OVERHEAD_SHARE = 0.03

LAYOUT_KERNELS = re.compile(r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw|SwapDimension",
                            re.IGNORECASE)
CONVOLUTION_KERNELS = re.compile(r"conv|fprop|dgrad|wgrad|winograd", re.IGNORECASE)
MATMUL_KERNELS = re.compile(r"gemm|conv|fprop|dgrad|wgrad|winograd|xmma|cutlass",
                            re.IGNORECASE)
EXCHANGE_KERNELS = re.compile(r"nccl", re.IGNORECASE)
# Volta and every NVIDIA data-centre and RTX GPU since have tensor cores.
TENSOR_CORE_GPUS = re.compile(
    r"V100|TITAN V|\bT4\b|RTX|A100|A800|\bA30\b|\bA40\b|\bA10G?\b|\bA16\b|\bA2\b|H100|H200|"
    r"H800|\bH20\b|GH200|\bL4\b|L40|B100|B200|GB200", re.IGNORECASE)
FULL_PRECISION = frozenset({"float32", "float64", "fp32"})


# ---- What the rules see ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Point:
    """One sample, reduced to what the rules need."""

    seconds: float  # the agent's monotonic clock
    user_seconds: float  # the process tree's totals
    system_seconds: float
    iowait_seconds: float
    target_busy_seconds: float  # the target alone: the process that launches kernels
    involuntary_switches: int
    runnable_threads: int | None
    rss_bytes: int
    host: HostSample | None
    gpu: GpuSample | None
    limits: LimitsSample | None
    probe: ProbeSample | None
    agent_cpu_seconds: float | None
    pids: frozenset[int]


@dataclass(frozen=True, slots=True)
class Window:
    """The samples of the last few seconds, oldest first, at least two."""

    points: tuple[Point, ...]

    @property
    def first(self) -> Point:
        return self.points[0]

    @property
    def last(self) -> Point:
        return self.points[-1]

    @property
    def seconds(self) -> float:
        return self.last.seconds - self.first.seconds

    def rate(self, read: Callable[[Point], float | None]) -> float | None:
        before, after = read(self.first), read(self.last)
        if before is None or after is None or self.seconds <= 0:
            return None
        return (after - before) / self.seconds

    def mean_runnable_threads(self) -> float | None:
        runnable = [p.runnable_threads for p in self.points]
        if any(r is None for r in runnable):
            return None
        return statistics.fmean(r for r in runnable if r is not None)

    def busy_cores(self) -> float:
        return ((self.last.user_seconds + self.last.system_seconds
                 - self.first.user_seconds - self.first.system_seconds) / self.seconds)

    def allowed_cpus(self) -> float | None:
        limits, host = self.last.limits, self.last.host
        allowed = limits.allowed_cpus if limits is not None else None
        if allowed is None and host is not None:
            allowed = host.logical_cpus
        return allowed

    # The probe's figures between the window's first and last samples.

    def probes(self) -> tuple[ProbeSample, ProbeSample] | None:
        first, last = self.first.probe, self.last.probe
        if first is None or last is None or first.pid != last.pid:
            return None
        return first, last

    def steady_steps(self) -> int:
        probes = self.probes()
        return 0 if probes is None else probes[1].steady_steps - probes[0].steady_steps

    def phase_seconds(self) -> tuple[dict[str, float], float] | None:
        """Seconds per phase, and steady step time, over the window's steps."""
        probes = self.probes()
        if probes is None or self.steady_steps() < MIN_WINDOW_STEPS:
            return None
        before, after = dict(probes[0].phase_seconds), dict(probes[1].phase_seconds)
        phases = {phase: seconds - before.get(phase, 0.0) for phase, seconds in after.items()}
        return phases, probes[1].step_seconds_sum - probes[0].step_seconds_sum

    def kernel_seconds(self) -> dict[str, float] | None:
        """GPU seconds per kernel name over the window, None without kernel records."""
        probes = self.probes()
        if probes is None:
            return None
        before_kernels, after_kernels = probes[0].kernels, probes[1].kernels
        if after_kernels is None or not after_kernels.traced or before_kernels is None:
            return None
        before = {(r.kernel, r.device): r.seconds for r in before_kernels.kernels}
        spent: dict[str, float] = {}
        for row in after_kernels.kernels:
            delta = row.seconds - before.get((row.kernel, row.device), 0.0)
            if delta > 0:
                spent[row.kernel] = spent.get(row.kernel, 0.0) + delta
        return spent if sum(spent.values()) > 0 else None

    def settings(self) -> dict[str, str]:
        probe = self.last.probe
        merged: dict[str, str] = {}
        for _, values in probe.settings if probe is not None else ():
            merged.update(values)
        return merged

    # NVML, for the devices the job is on.

    def gpu_utilization(self) -> float | None:
        """Mean over the window of the job's SM share (or its devices' utilization)."""
        values = []
        for point in self.points:
            gpu = point.gpu
            if gpu is None or not gpu.available:
                continue
            mine = [p for p in gpu.processes if p.pid in point.pids]
            shares = [p.sm_utilization_ratio for p in mine if p.sm_utilization_ratio is not None]
            if shares:
                values.append(statistics.fmean(shares))
                continue
            indexes = {p.gpu_index for p in mine}
            devices = [d.utilization_ratio for d in gpu.devices
                       if d.index in indexes and d.utilization_ratio is not None]
            if devices:
                values.append(statistics.fmean(devices))
        return statistics.fmean(values) if values else None

    def job_gpus(self) -> list[tuple[str, int | None, int | None]]:
        """(name, memory used, memory total) of each device the job holds memory on."""
        gpu = self.last.gpu
        if gpu is None or not gpu.available:
            return []
        indexes = {p.gpu_index for p in gpu.processes if p.pid in self.last.pids}
        return [(d.name, d.memory_used_bytes, d.memory_total_bytes)
                for d in gpu.devices if d.index in indexes and d.up]


@dataclass(frozen=True, slots=True)
class Check:
    """A rule's answer for one window: whether the cause holds, and the figures."""

    holds: bool
    evidence: Mapping[str, float]


Rule = Callable[[Window], Check | None]


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def _kernel_share(spent: Mapping[str, float], pattern: re.Pattern[str]) -> float:
    return _share(sum(s for k, s in spent.items() if pattern.search(k)), sum(spent.values()))


# ---- The rules ------------------------------------------------------------------------------


def thread_oversubscription(window: Window) -> Check | None:
    mean_runnable = window.mean_runnable_threads()
    allowed = window.allowed_cpus()
    if allowed is None or mean_runnable is None:
        return None
    user = window.last.user_seconds - window.first.user_seconds
    system = window.last.system_seconds - window.first.system_seconds
    cpu = user + system
    involuntary = window.last.involuntary_switches - window.first.involuntary_switches
    per_cpu_second = _share(involuntary, cpu)
    system_share = _share(system, cpu)
    queued = mean_runnable >= max(allowed * RUNNABLE_PER_ALLOWED_CPU, allowed + 1)
    contended = per_cpu_second >= INVOLUNTARY_PER_CPU_SECOND or system_share >= SYSTEM_SHARE
    return Check(queued and contended, {
        "runnable_threads": mean_runnable, "allowed_cpus": allowed,
        "involuntary_switches_per_cpu_second": per_cpu_second,
        "system_cpu_ratio": system_share})


def cpu_contention(window: Window) -> Check | None:
    runnable = window.mean_runnable_threads()
    allowed = window.allowed_cpus()
    host_busy = window.rate(_host_busy_seconds)
    host = window.last.host
    if runnable is None or allowed is None or host_busy is None or host is None:
        return None
    wanted = min(runnable, allowed)  # what its runnable threads could use at most
    received = _share(window.busy_cores(), wanted) if wanted > 0 else 1.0
    host_share = host_busy / host.logical_cpus
    return Check(runnable >= 0.5 and received < CONTENTION_SHARE
                 and host_share >= HOST_BUSY_SHARE,
                 {"runnable_threads": runnable, "busy_cores": window.busy_cores(),
                  "received_cpu_ratio": min(received, 1.0), "host_busy_ratio": host_share})


def _host_busy_seconds(point: Point) -> float | None:
    if point.host is None:
        return None
    return sum(s for mode, s in point.host.cpu_seconds if mode not in ("idle", "iowait"))


def input_bound(window: Window) -> Check | None:
    split = window.phase_seconds()
    if split is None:
        return None
    phases, step_seconds = split
    if step_seconds <= 0:
        return None
    evidence = {"step_seconds": step_seconds / window.steady_steps(),
                "busy_cores": window.busy_cores()}
    runnable = window.mean_runnable_threads()
    if runnable is not None:
        evidence["runnable_threads"] = runnable
    gpu = window.gpu_utilization()
    if gpu is not None:
        evidence["gpu_utilization_ratio"] = gpu
    if phases.get("forward", 0.0) + phases.get("backward", 0.0) > 0:
        # Layer timing splits the step: "other" is what no hook saw.
        other = _share(phases.get("other", 0.0), step_seconds)
        evidence["other_step_ratio"] = other
        holds = other >= OTHER_SHARE and (gpu is None or gpu < LOW_GPU_UTILIZATION)
        return Check(holds, evidence)
    # The host waits: little CPU, and not for want of CPUs.
    waiting = evidence["busy_cores"] < WAITING_CORES and (
        runnable is None or runnable < WAITING_RUNNABLE_THREADS)
    # With a GPU, it must idle between steps too: neither side computes.
    return Check(waiting and (gpu is None or gpu < LOW_GPU_UTILIZATION), evidence)


def launch_bound(window: Window) -> Check | None:
    gpu = window.gpu_utilization()
    if gpu is None:
        return None
    launcher = (window.last.target_busy_seconds - window.first.target_busy_seconds) \
        / window.seconds
    evidence = {"gpu_utilization_ratio": gpu, "launcher_busy_cores": launcher}
    split = window.phase_seconds()
    waiting_on_input = False
    if split is not None and split[1] > 0 and split[0].get("forward", 0.0) > 0:
        other = _share(split[0].get("other", 0.0), split[1])
        evidence["other_step_ratio"] = other
        waiting_on_input = other >= OTHER_SHARE  # that is input_bound's case
    return Check(gpu < LOW_GPU_UTILIZATION and launcher >= LAUNCH_BUSY_CORES
                 and not waiting_on_input, evidence)


def layout_transposes(window: Window) -> Check | None:
    spent = window.kernel_seconds()
    if spent is None:
        return None
    share = _kernel_share(spent, LAYOUT_KERNELS)
    return Check(share >= LAYOUT_SHARE, {
        "layout_kernel_ratio": share,
        "layout_kernel_seconds_per_second": share * sum(spent.values()) / window.seconds})


def autotune_off(window: Window) -> Check | None:
    spent = window.kernel_seconds()
    autotune = window.settings().get("cudnn_autotune")
    if spent is None or autotune is None:
        return None
    convolution = _kernel_share(spent, CONVOLUTION_KERNELS) + _kernel_share(spent,
                                                                             LAYOUT_KERNELS)
    return Check(autotune == "off" and convolution >= CONVOLUTION_SHARE,
                 {"convolution_kernel_ratio": convolution,
                  "autotune_on": 1.0 if autotune == "on" else 0.0})


def fp32_on_tensor_cores(window: Window) -> Check | None:
    spent = window.kernel_seconds()
    precision = window.settings().get("precision")
    gpus = window.job_gpus()
    if spent is None or precision is None or not gpus:
        return None
    tensor_cores = any(TENSOR_CORE_GPUS.search(name) for name, _, _ in gpus)
    matmul = _kernel_share(spent, MATMUL_KERNELS)
    full = precision.lower() in FULL_PRECISION
    return Check(tensor_cores and full and matmul >= MATMUL_SHARE,
                 {"matmul_kernel_ratio": matmul, "tensor_cores": 1.0 if tensor_cores else 0.0,
                  "full_precision": 1.0 if full else 0.0})


def _memory_limit(window: Window) -> float | None:
    limits, host = window.last.limits, window.last.host
    candidates = [limits.memory_limit_bytes if limits is not None else None,
                  host.memory_total_bytes if host is not None else None]
    known = [c for c in candidates if c]
    return min(known) if known else None


def memory_near_limit(window: Window) -> Check | None:
    limit = _memory_limit(window)
    if limit is None:
        return None
    rss = window.last.rss_bytes
    return Check(rss >= MEMORY_NEAR_LIMIT * limit,
                 {"resident_bytes": rss, "limit_bytes": limit,
                  "resident_to_limit_ratio": rss / limit})


def memory_stalls(window: Window) -> Check | None:
    limit = _memory_limit(window)
    iowait = (window.last.iowait_seconds - window.first.iowait_seconds) / window.seconds
    evidence: dict[str, float] = {"iowait_ratio": iowait}
    holds = False
    if limit is not None:
        ratio = window.last.rss_bytes / limit
        evidence["resident_to_limit_ratio"] = ratio
        holds = iowait >= IOWAIT_SHARE and ratio >= MEMORY_STALL_LIMIT_SHARE
    swap_in = window.rate(lambda p: None if p.host is None else p.host.swap_in_bytes)
    if swap_in is not None:
        evidence["swap_in_bytes_per_second"] = swap_in
        holds = holds or swap_in >= SWAP_IN_BYTES_PER_SECOND
    limits = window.last.limits
    if limits is not None and limits.memory_stall_ratio is not None:
        evidence["memory_stall_ratio"] = limits.memory_stall_ratio
        holds = holds or limits.memory_stall_ratio >= MEMORY_STALL_SHARE
    return Check(holds, evidence)


def gpu_memory_near_total(window: Window) -> Check | None:
    devices = [(used, total) for _, used, total in window.job_gpus() if used and total]
    if not devices:
        return None
    used, total = max(devices, key=lambda d: d[0] / d[1])
    return Check(used >= GPU_MEMORY_NEAR_TOTAL * total,
                 {"gpu_memory_used_bytes": used, "gpu_memory_total_bytes": total,
                  "gpu_memory_used_ratio": used / total})


def gradient_exchange(window: Window) -> Check | None:
    spent = window.kernel_seconds()
    if spent is None:
        return None
    exchange = sum(s for k, s in spent.items() if EXCHANGE_KERNELS.search(k))
    if exchange <= 0:
        return None  # not a data-parallel job on NCCL: nothing to judge
    evidence = {"exchange_kernel_ratio": _share(exchange, sum(spent.values()))}
    steps = window.steady_steps()
    if steps > 0:
        evidence["exchange_seconds_per_step"] = exchange / steps
    return Check(evidence["exchange_kernel_ratio"] >= EXCHANGE_SHARE, evidence)


def measurement_partial(window: Window) -> Check | None:
    probes = window.probes()
    if probes is None:
        return None
    first, last = probes
    hook_errors = last.hook_errors - first.hook_errors
    evidence: dict[str, float] = {"hook_errors": hook_errors}
    holds = hook_errors > 0
    if last.kernels is not None:
        busy = last.kernels.state == "busy"
        dropped = last.kernels.dropped_records - (first.kernels.dropped_records
                                                  if first.kernels is not None else 0)
        evidence.update(kernel_tracing_busy=1.0 if busy else 0.0, dropped_records=dropped)
        holds = holds or busy or dropped > 0
    return Check(holds, evidence)


def measurement_costly(window: Window) -> Check | None:
    agent = window.rate(lambda p: p.agent_cpu_seconds)
    if agent is None:
        return None
    evidence = {"agent_busy_cores": agent}
    holds = agent >= AGENT_CORES
    probes = window.probes()
    if probes is not None and probes[1].kernels is not None and probes[0].kernels is not None:
        cupti = (probes[1].kernels.overhead_seconds
                 - probes[0].kernels.overhead_seconds) / window.seconds
        evidence["cupti_overhead_ratio"] = cupti
        holds = holds or cupti >= CUPTI_OVERHEAD_SHARE
    return Check(holds, evidence)


# ---- The catalogue -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Kind:
    """What a finding is: its stable id, severity, meaning and what to try."""

    id: str
    severity: str
    summary: str
    advice: str
    rule: Rule


KINDS: tuple[Kind, ...] = (
    Kind("memory_near_limit", "critical",
         "resident memory is near the job's memory limit: the OOM killer is next",
         "lower the batch size or loader workers, or raise the cgroup/host memory limit",
         memory_near_limit),
    Kind("memory_stalls", "warning",
         "the job waits on memory: swapping, reclaim stalls or iowait near its limit",
         "free memory (smaller batch, fewer workers, smaller shuffle buffer) before tuning "
         "anything else", memory_stalls),
    Kind("gpu_memory_near_total", "warning",
         "GPU memory is nearly full",
         "lower the batch size or use activation checkpointing; under TensorFlow, "
         "memory growth (allow_growth) shows what the job really needs", gpu_memory_near_total),
    Kind("thread_oversubscription", "warning",
         "more runnable threads than the CPUs the job may use: threads queue and preempt "
         "each other",
         "lower the thread counts (torch.set_num_threads, OMP_NUM_THREADS, intra-op threads, "
         "loader workers) to the allowed CPUs", thread_oversubscription),
    Kind("cpu_contention", "warning",
         "the job's runnable threads get less than half the CPU they could use: other "
         "processes keep the host's CPUs busy",
         "give the job CPUs of its own (a cpuset, taskset, a dedicated node) or move its "
         "neighbours; until then its step time measures them too", cpu_contention),
    Kind("input_bound", "warning",
         "the step waits for input: most of it is outside forward, backward and optimizer",
         "load data in parallel (DataLoader num_workers, tf.data prefetch), cache or "
         "pre-decode the data set", input_bound),
    Kind("launch_bound", "warning",
         "the GPU idles while the launching process keeps a core busy",
         "larger batches, fewer and larger kernels (torch.compile, CUDA graphs, fused "
         "optimizers)", launch_bound),
    Kind("layout_transposes", "warning",
         "layout conversions (NCHW<->NHWC transposes) take a share of GPU time",
         "train channels-last: model.to(memory_format=torch.channels_last) and the same for "
         "inputs; data_format='channels_last' in TensorFlow", layout_transposes),
    Kind("autotune_off", "warning",
         "convolutions take much of the GPU time and cuDNN autotuning is off",
         "torch.backends.cudnn.benchmark = True for fixed input shapes "
         "(TF_CUDNN_USE_AUTOTUNE=1 in TensorFlow)", autotune_off),
    Kind("fp32_on_tensor_cores", "warning",
         "full precision on a GPU with tensor cores, where GEMMs and convolutions are much "
         "of the GPU time",
         "mixed precision: torch.autocast with bfloat16 or float16 (and a GradScaler for "
         "float16); the mixed_float16 policy in Keras", fp32_on_tensor_cores),
    Kind("gradient_exchange", "warning",
         "gradient exchange (NCCL all-reduce) takes a large share of GPU time",
         "overlap it with backward (DDP bucket_cap_mb, gradient_as_bucket_view), larger "
         "batches per GPU, or gradient compression", gradient_exchange),
    Kind("measurement_costly", "warning",
         "the agent or its CUPTI tracing costs the job noticeable time",
         "raise --interval, leave out --layers, or --no-kernels", measurement_costly),
    Kind("measurement_partial", "info",
         "some measurements are partial: probe hook errors, CUPTI dropped records, or "
         "another profiler holds CUPTI",
         "read the step and kernel figures as lower bounds until this clears; the agent's "
         "log says why", measurement_partial),
)
KINDS_BY_ID = {kind.id: kind for kind in KINDS}


@dataclass(frozen=True, slots=True)
class Finding:
    """One rule's state for one target at one pass."""

    kind: Kind
    active: bool  # raised: the cause has held long enough and not cleared since
    evidence: tuple[tuple[str, float], ...]
    since_seconds: float | None = None  # monotonic time it was raised, while active

    @property
    def id(self) -> str:
        return self.kind.id

    @property
    def severity(self) -> str:
        return self.kind.severity


@dataclass
class _Hysteresis:
    holding_since: float | None = None
    gone_since: float | None = None
    raised_at: float | None = None

    def step(self, holds: bool, now: float) -> bool:
        """Whether the finding is raised after this pass."""
        if holds:
            self.gone_since = None
            if self.holding_since is None:
                self.holding_since = now
            if self.raised_at is None and now - self.holding_since >= RAISE_AFTER_SECONDS:
                self.raised_at = now
        else:
            self.holding_since = None
            if self.raised_at is not None:
                if self.gone_since is None:
                    self.gone_since = now
                if now - self.gone_since >= CLEAR_AFTER_SECONDS:
                    self.raised_at = self.gone_since = None
        return self.raised_at is not None


def point_of(snapshot: Snapshot, *, host: HostSample | None = None,
             gpu: GpuSample | None = None) -> Point:
    ps = snapshot.processes
    runnable = [p.runnable_threads for p in ps]
    target = snapshot.target
    agent: AgentSelfSample | None = snapshot.agent
    return Point(
        seconds=snapshot.monotonic_seconds,
        user_seconds=sum(p.user_seconds for p in ps),
        system_seconds=sum(p.system_seconds for p in ps),
        iowait_seconds=sum(p.iowait_seconds for p in ps),
        target_busy_seconds=(target.user_seconds + target.system_seconds
                             if target is not None else 0.0),
        involuntary_switches=sum(p.involuntary_context_switches for p in ps),
        runnable_threads=(None if not ps or any(r is None for r in runnable)
                          else sum(r for r in runnable if r is not None)),
        rss_bytes=sum(p.rss_bytes for p in ps),
        host=host if host is not None else snapshot.host,
        gpu=gpu if gpu is not None else snapshot.gpu,
        limits=snapshot.limits, probe=snapshot.probe,
        agent_cpu_seconds=agent.cpu_seconds if agent is not None else None,
        pids=frozenset(p.pid for p in ps))


@dataclass
class FindingsTracker:
    """The findings of one target, pass after pass. Not thread-safe: the sampling
    loop owns it."""

    kinds: tuple[Kind, ...] = KINDS
    window_seconds: float = WINDOW_SECONDS
    _points: deque[Point] = field(default_factory=deque, init=False)
    _states: dict[str, _Hysteresis] = field(default_factory=dict, init=False)

    def update(self, point: Point) -> tuple[Finding, ...]:
        """Add one pass; return every rule that could judge it, raised or not."""
        points = self._points
        if points and point.pids.isdisjoint(points[-1].pids):
            points.clear()  # another process: its history is not this one's
        points.append(point)
        # Keep one point older than the window, so the window spans all of it.
        while len(points) > 2 and points[1].seconds <= point.seconds - self.window_seconds:
            points.popleft()
        if point.seconds - points[0].seconds < MIN_WINDOW_SECONDS:
            return ()
        window = Window(tuple(points))
        findings = []
        for kind in self.kinds:
            state = self._states.setdefault(kind.id, _Hysteresis())
            try:
                check = kind.rule(window)
            except (ArithmeticError, ValueError):
                check = None  # a figure the platform gave oddly: no judgement this pass
            if check is None:
                self._states[kind.id] = _Hysteresis()
                continue
            active = state.step(check.holds, point.seconds)
            findings.append(Finding(kind, active, tuple(sorted(check.evidence.items())),
                                    state.raised_at))
        return tuple(findings)


def active(findings: tuple[Finding, ...]) -> list[Finding]:
    """The raised ones, most severe first."""
    return sorted((f for f in findings if f.active),
                  key=lambda f: (-SEVERITIES.index(f.severity), f.id))
