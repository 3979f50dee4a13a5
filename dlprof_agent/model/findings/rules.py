"""The rules: each a pure function of a Window that answers None when the job
gives it nothing to judge, else whether its cause holds now, with the figures
that say so. Thresholds are named with their reasoning and sources;
docs/findings.md lists the rules."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dlprof_agent.model.findings.window import Point, Window

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
# The main thread's run-queue wait is read once it was runnable this share of the
# window: a job asleep or waiting for I/O has too little of it to judge.
MAIN_RUNNABLE_SHARE = 0.2
# ...and it is starved once it waited this share of its runnable time. Measured on a
# 2-core VM, a thread alone on its CPU waits 0.02% of it; beside one busy thread 51%,
# two 65%; a DDP rank beside two, 52% (waking from its wait in the all-reduce, CFS
# lets it run ahead of them).
MAIN_WAIT_SHARE = 0.3
# Input-bound. With every phase of the step measured (window.SPLIT_PHASES, or
# COMPILED_SPLIT_PHASES for a torch.compile'd train step),
# "other" is the step time no hook saw: data loading, the loss and the loop's
# Python. The loss and the loop are a few per cent of a step; half the step there
# is time spent waiting for data. A rank of a process group waits for its peers in
# collectives; once the probe measures that wait as the phase "exchange" it is out
# of "other", and until then such a rank gets no input verdict.
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
    """Either the job's threads get under half the CPU they could use on a busy host,
    or its main thread (a training loop's critical path) waited in a run queue for
    MAIN_WAIT_SHARE of its runnable time: contention on the CPUs it may use, however
    idle the rest of the host (a rank pinned to a core it shares)."""
    runnable = window.mean_runnable_threads()
    allowed = window.allowed_cpus()
    host_busy = window.rate(_host_busy_seconds)
    host = window.last.host
    main = window.main_thread_waits()
    main_starved = False
    evidence: dict[str, float] = {}
    if main is not None and main[1] >= MAIN_RUNNABLE_SHARE * window.seconds:
        denied = main[0] / main[1]
        evidence["main_thread_run_queue_wait_ratio"] = denied
        main_starved = denied >= MAIN_WAIT_SHARE
    if runnable is None or allowed is None or host_busy is None or host is None:
        return Check(True, evidence) if main_starved else None
    wanted = min(runnable, allowed)  # what its runnable threads could use at most
    received = _share(window.busy_cores(), wanted) if wanted > 0 else 1.0
    host_share = host_busy / host.logical_cpus
    evidence.update({"runnable_threads": runnable, "busy_cores": window.busy_cores(),
                     "received_cpu_ratio": min(received, 1.0), "host_busy_ratio": host_share})
    return Check(main_starved or (runnable >= 0.5 and received < CONTENTION_SHARE
                                  and host_share >= HOST_BUSY_SHARE), evidence)


def _host_busy_seconds(point: Point) -> float | None:
    if point.host is None:
        return None
    return sum(s for mode, s in point.host.cpu_seconds if mode not in ("idle", "iowait"))


def input_bound(window: Window) -> Check | None:
    if window.exchange_unmeasured():
        return None  # its wait in collectives would read as waiting for input
    split = window.phase_seconds()
    if split is None:
        return None
    step_seconds = split[1]
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
    measured = window.step_split()
    if measured is not None:
        # Every phase was seen: "other" is what no hook saw, the loader among it.
        other = _share(measured[0].get("other", 0.0), step_seconds)
        evidence["other_step_ratio"] = other
        if "exchange" in measured[0]:
            evidence["exchange_step_ratio"] = _share(measured[0]["exchange"], step_seconds)
        holds = other >= OTHER_SHARE and (gpu is None or gpu < LOW_GPU_UTILIZATION)
        return Check(holds, evidence)
    # No split, or one with phases missing (their time is in "other"): the host
    # must wait, with little CPU and not for want of CPUs.
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
    split = window.step_split()  # a partial split cannot tell input from a missed phase
    waiting_on_input = False
    if split is not None and split[1] > 0 and not window.exchange_unmeasured():
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


def series_capped(window: Window) -> Check | None:
    """The budget folded rows of this target's last sample (probe_link/series_budget.py)."""
    probe = window.last.probe
    if probe is None:
        return None
    return Check(probe.series_folded > 0, {"series_folded": float(probe.series_folded)})


# Which rule judges each kind of the catalogue (model/findings.py).
RULES: dict[str, Rule] = {
    "memory_near_limit": memory_near_limit,
    "memory_stalls": memory_stalls,
    "gpu_memory_near_total": gpu_memory_near_total,
    "thread_oversubscription": thread_oversubscription,
    "cpu_contention": cpu_contention,
    "input_bound": input_bound,
    "launch_bound": launch_bound,
    "layout_transposes": layout_transposes,
    "autotune_off": autotune_off,
    "fp32_on_tensor_cores": fp32_on_tensor_cores,
    "gradient_exchange": gradient_exchange,
    "measurement_costly": measurement_costly,
    "measurement_partial": measurement_partial,
    "series_capped": series_capped,
}
