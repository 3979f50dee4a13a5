"""The Prometheus rules file the agent ships (deploy/prometheus/rules.yml), as code:
the recording rules the dashboards read, the job's per-rank figures, and the alerts.

`rules_file(RuleOptions())` is the shipped file byte for byte; `dlprof-agent rules`
prints it with another rate window, `for` duration or scrape job. Names follow
Prometheus's level:metric:operations convention. The job's rules aggregate to
`job_id` and `rank` (the labels the agent puts on a rank's step, phase and findings
series), so they hold across nodes, pid reuse and restarts; their names carry no
window, so the job dashboard and the alerts read the same names whatever
`--rate-window` is. A target whose `job_id` or `rank` is "" (unknown) is left out
of them.

Kept in one file: the rules read one another's names, in the order Prometheus
evaluates a group, and the thresholds they share sit beside them.

A rank's own time per step is its step time less the time it waited in
collectives: phase `exchange` on the host or, on NCCL, whose collectives return once
queued, the GPU time of its NCCL kernels, whichever is larger. In synchronous data
parallelism every rank's step takes as long as the slowest rank's, so step time
cannot find the slow rank; own time can, and the cause is in that rank's own signals.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

# A straggler's own time per step is above the job's median by at least this share
# of the job's median step time: every other rank waits that long for it each step,
# so the job loses that share of its throughput to it. A fifth: a healthy 2-rank job
# on a shared 2-core machine reached 11.8% over 10 s windows, and the faults that
# benchmarks/stragglers.py injects give 24-31%. With two ranks the median is their
# mean, so a 20% excess is a 40% difference between them...
STRAGGLER_STEP_SHARE = 0.2
# ...and by at least this many seconds, so that sub-millisecond steps do not raise
# it on the scheduler's noise.
STRAGGLER_FLOOR_SECONDS = 0.0005
# A rank above the median by this share (and the floor) is not alerted on, but it is
# the first suspect of a slow exchange: its own side of each collective runs slow
# too, so DlprofSlowExchange stays silent while one stands out this much.
SUSPECT_STEP_SHARE = 0.1
# A cause explains a straggler when its figure is at least this share of the
# rank's excess own time ("most of it").
CAUSE_SHARE = 0.5
# A job whose least-waiting rank spends this share of its step in collectives is
# held up by the exchange itself: no rank makes it wait that long. The same fifth
# of the step as the gradient_exchange finding (Kim et al., §VI). Held for --for
# (2m): a healthy job's least-waiting share passes a fifth for seconds at a time on
# a shared machine...
SLOW_EXCHANGE_SHARE = 0.2
# ...while twice that, held for STRAGGLER_FOR, names a link gone slow within
# seconds: a link throttled to 150 Mbit/s gave 0.58 (docs/results/stragglers.md).
SLOW_EXCHANGE_FAST_SHARE = 0.4
# The NVML throttle reasons that slow one GPU down. sw_power_cap is left out: under
# full load every GPU of a job sits at its power cap.
GPU_SLOWDOWN_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
                        "sw_thermal_slowdown")
# The findings (model/findings/catalogue.py) that name a rank's cause.
CPU_STARVED_FINDINGS = ("cpu_contention", "thread_oversubscription")
MEMORY_PRESSURE_FINDINGS = ("memory_near_limit", "memory_stalls")
PAGING_FINDING = "memory_stalls"  # the rank swaps or stalls on memory, not only nears it
# A probe that was up within this time and is not now has gone down.
PROBE_MEMORY = "1h"

DEFAULT_RATE_WINDOW = "1m"
DEFAULT_FOR = "2m"
# Windows counted in steps: a rank's figures per step are its means over the last
# STEP_WINDOW when it ended at least STEP_WINDOW_MIN_STEPS steps in it, else over the
# rate window. Ten 1 s scrapes; a job of 20+ steps in 10 s is judged on its latest
# steps, a slower one (or a slower scrape, which leaves the short window empty) on the
# rate window's.
STEP_WINDOW = "10s"
STEP_WINDOW_MIN_STEPS = 20
# A straggler must hold at every evaluation for this long: on a 10 s window that is
# an excess held over several consecutive short windows, where a healthy job's noise
# (a neighbour's burst on one rank's core) flickers. Measured in
# docs/results/stragglers.md; --for sets the other alerts'. DlprofSlowExchange fires
# after it too, on SLOW_EXCHANGE_FAST_SHARE; its lower bar must hold for --for.
STRAGGLER_FOR = "5s"
# The `job` label of the agents' scrape: the shipped prometheus.yml's job and the
# ServiceMonitor's (the Service's name).
DEFAULT_SCRAPE_JOB = "dlprof|dlprof-agent"

# The recording rules the overview, layers and threads dashboards read
# (grafana/overview.py, layers.py, threads.py). They precompute the rates that several
# panels share or that topk() would otherwise compute over hundreds of layer or kernel
# series on every refresh, and keep their 1m window whatever --rate-window is: their
# names say 1m.
CPU_RATE = "instance_pid_mode:dlprof_process_cpu_seconds:rate1m"
THREAD_CPU_RATE = "instance_pid_thread_name_mode:dlprof_thread_group_cpu_seconds:rate1m"
STEP_MEAN = "instance_pid:dlprof_step_duration_seconds:mean1m"
LAYER_RATE = "instance_pid_layer_phase:dlprof_layer_seconds:rate1m"
KERNEL_RATE = "instance_pid_gpu_kernel:dlprof_kernel_seconds:rate1m"

# The job's rules.
JOB_SAMPLES_RATE = "job_id:dlprof_samples:rate"
RANK_STEPS_RATE = "job_id_rank:dlprof_steps:rate"
RANK_STEP_MEAN = "job_id_rank:dlprof_step_duration_seconds:mean"
RANK_PHASE_MEAN = "job_id_rank_phase:dlprof_step_phase_seconds:mean"
RANK_COLLECTIVE_MEAN = "job_id_rank:dlprof_collective_kernel_seconds:mean"
RANK_WAIT_MEAN = "job_id_rank:dlprof_step_wait_seconds:mean"
RANK_OWN_MEAN = "job_id_rank:dlprof_step_own_seconds:mean"
JOB_OWN_MEDIAN = "job_id:dlprof_step_own_seconds:median"
JOB_STEP_MEDIAN = "job_id:dlprof_step_duration_seconds:median"
JOB_PHASE_MEDIAN = "job_id_phase:dlprof_step_phase_seconds:median"
RANK_OWN_ABOVE_MEDIAN = "job_id_rank:dlprof_step_own_seconds:above_median"
RANK_PHASE_ABOVE_MEDIAN = "job_id_rank_phase:dlprof_step_phase_seconds:above_median"
JOB_STEP_SKEW = "job_id:dlprof_step_own_seconds:max_over_median"
JOB_EXCHANGE_SHARE = "job_id:dlprof_step_exchange_seconds:ratio"
JOB_SCALING_EFFICIENCY = "job_id:dlprof_scaling_efficiency:ratio"
JOB_LEAST_WAIT_SHARE = "job_id:dlprof_step_wait_seconds:min_ratio"
JOB_RANKS_UP = "job_id:dlprof_ranks_up:count"
JOB_WORLD_SIZE = "job_id:dlprof_target_world_size:max"
RANK_GPU_SLOWDOWN = "job_id_rank:dlprof_gpu_throttle_reason_active:max"
RANK_RUN_QUEUE_MEAN = "job_id_rank:dlprof_process_main_thread_run_queue_wait_seconds:mean"
RANK_STRAGGLER_EXCESS = "job_id_rank:dlprof_step_own_seconds:straggler_excess"
RANK_STRAGGLER_CAUSE = "job_id_rank_cause:dlprof_step_own_seconds:straggler_excess"

STRAGGLER_ALERT = "DlprofStragglerRank"
SLOW_EXCHANGE_ALERT = "DlprofSlowExchange"
STALLED_ALERT = "DlprofJobStalled"
MISSING_RANKS_ALERT = "DlprofMissingRanks"
AGENT_DOWN_ALERT = "DlprofAgentDown"
PROBE_DOWN_ALERT = "DlprofProbeDown"

# Every straggler cause, in the order the rule tries them; the first four are the
# rank's own signals and may hold together, `compute` and `unknown` only without them.
CAUSES = ("input", "cpu_starved", "gpu_throttled", "memory_pressure", "compute", "unknown")

_RANKED = 'job_id!="",rank!=""'
# Prometheus's duration syntax (model.ParseDuration): units largest first, each once.
_DURATION = re.compile(r"(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?"
                       r"(?:(\d+)s)?(?:(\d+)ms)?")
# What Python's regular expressions have and RE2's do not.
_NOT_RE2 = re.compile(r"\(\?<?[=!]|\\[1-9]")
_UNIT_MS = (365 * 86_400_000, 7 * 86_400_000, 86_400_000, 3_600_000, 60_000, 1000, 1)


def duration_ms(text: str) -> int:
    """A Prometheus duration (``1m``, ``90s``, ``1h30m``) in milliseconds; ValueError
    for anything Prometheus would refuse."""
    match = _DURATION.fullmatch(text)
    if text == "0":
        return 0
    if not text or match is None:
        raise ValueError(f"{text!r} is not a Prometheus duration (e.g. 30s, 1m, 1h30m)")
    return sum(int(count) * unit for count, unit in zip(match.groups(), _UNIT_MS, strict=True)
               if count is not None)


@dataclass(frozen=True)
class RuleOptions:
    """What `dlprof-agent rules` lets a user choose; the defaults make the shipped file."""

    rate_window: str = DEFAULT_RATE_WINDOW  # a Prometheus duration, above 0
    for_: str = DEFAULT_FOR  # how long a condition holds before its alert fires
    straggler_for: str = STRAGGLER_FOR  # the same for the straggler alert
    straggler_share: float = STRAGGLER_STEP_SHARE  # the straggler's bar, of the step
    scrape_job: str = DEFAULT_SCRAPE_JOB  # a regex for `up`'s job label

    def __post_init__(self) -> None:
        if duration_ms(self.rate_window) <= 0:
            raise ValueError(f"a rate window of {self.rate_window} holds no samples")
        duration_ms(self.for_)
        duration_ms(self.straggler_for)
        if not 0 < self.straggler_share < 1:
            raise ValueError(f"a straggler share of {self.straggler_share:g} is not a share "
                             "of the step between 0 and 1")
        try:
            re.compile(self.scrape_job)
        except re.error as error:
            raise ValueError(f"{self.scrape_job!r} is not a regular expression: {error}"
                             ) from None
        if _NOT_RE2.search(self.scrape_job):
            raise ValueError(f"{self.scrape_job!r} needs lookaround or backreferences, which "
                             "Prometheus's regular expressions (RE2) do not have")


@dataclass(frozen=True)
class Record:
    comment: str
    name: str
    expr: str


@dataclass(frozen=True)
class Alert:
    comment: str
    name: str
    expr: str
    for_: str
    labels: tuple[tuple[str, str], ...]
    annotations: tuple[tuple[str, str], ...]


Rule = Record | Alert


def _any_of(values: tuple[str, ...]) -> str:
    return "|".join(values)


def _with_cause(condition: str, cause: str, ranks: str = RANK_STRAGGLER_EXCESS) -> str:
    """The stragglers (or other ``ranks``) for which `condition` holds, labelled with
    `cause`."""
    inner = condition.replace("\n", "\n    ")
    ranks = ranks.replace("\n", "\n  ")
    return (f"label_replace(\n  {ranks}\n  and on (job_id, rank)\n"
            f'  (\n    {inner}\n  ),\n  "cause", "{cause}", "", "")')


def dashboard_rules() -> list[Record]:
    """The rules the overview, layers and threads dashboards read (grafana/panels.py)."""
    return [
        Record("CPU cores by mode per process: the CPU, system-share and host-share panels.",
               CPU_RATE, "rate(dlprof_process_cpu_seconds_total[1m])"),
        Record("Cores per thread group (up to 64 names per process) by mode.",
               THREAD_CPU_RATE, "rate(dlprof_thread_group_cpu_seconds_total[1m])"),
        Record("Mean steady-state step time; NaN when no step ended in the last minute.",
               STEP_MEAN, "rate(dlprof_step_duration_seconds_sum[1m]) / "
                          "rate(dlprof_step_duration_seconds_count[1m])"),
        Record("Share of wall time in each layer (up to 512 per process), for topk() panels.",
               LAYER_RATE, "rate(dlprof_layer_seconds_total[1m])"),
        Record("Share of wall time in each kernel; from the CUPTI tracer, empty without it.",
               KERNEL_RATE, "rate(dlprof_kernel_seconds_total[1m])"),
    ]


def _steps_counted(per_step: Callable[[str], str], window: str) -> str:
    """`per_step` (an expression of a window) over STEP_WINDOW for the ranks that
    ended STEP_WINDOW_MIN_STEPS steps in it, over `window` for the others."""
    if duration_ms(window) <= duration_ms(STEP_WINDOW):
        return per_step(window)
    enough = ("sum by (job_id, rank) (increase(dlprof_step_duration_seconds_count"
              f"{{{_RANKED}}}[{STEP_WINDOW}])) >= {STEP_WINDOW_MIN_STEPS}")
    short = per_step(STEP_WINDOW).replace("\n", "\n  ")
    return f"(\n  {short}\n)\nand on (job_id, rank) ({enough})\nor\n{per_step(window)}"


def job_rules(window: str, straggler_share: float = STRAGGLER_STEP_SHARE) -> list[Record]:
    """Per job and per rank: throughput, the time split per step, and the stragglers."""

    def steps(over: str) -> str:
        return ("sum by (job_id, rank) (rate(dlprof_step_duration_seconds_count"
                f"{{{_RANKED}}}[{over}])) > 0")

    # Input, unless the rank pages: a data path that reads memory swapped out waits on
    # the paging, and memory is the cause to fix (the memory fault of
    # benchmarks/stragglers.py slows its rank's batch sampling).
    paging = (f'max by (job_id, rank) (dlprof_finding{{{_RANKED},'
              f'finding="{PAGING_FINDING}"}}) == 1')
    input_excess = (f'{RANK_PHASE_ABOVE_MEDIAN}{{phase="other"}}\n'
                    f"  >= ignoring (phase) ({CAUSE_SHARE} * {RANK_STRAGGLER_EXCESS})\n"
                    f"unless on (job_id, rank)\n{paging}")
    compute_excess = (f"sum by (job_id, rank) ({RANK_PHASE_ABOVE_MEDIAN}"
                      '{phase=~"forward|backward|compiled|optimizer"})\n'
                      f"  >= ({CAUSE_SHARE} * {RANK_STRAGGLER_EXCESS})")
    # A CPU finding names the cause unless the rank's main thread waited for its CPU
    # less than half its excess per step more than the median rank's: on a shared
    # machine a rank that computes or sleeps longer for another reason meets the
    # finding's threshold too, and then the finding is not why it is slow.
    run_queue_above = (f"{RANK_RUN_QUEUE_MEAN}\n  - on (job_id) group_left ()\n"
                       f"  quantile by (job_id) (0.5, {RANK_RUN_QUEUE_MEAN})")
    cpu = (f'max by (job_id, rank) (dlprof_finding{{{_RANKED},'
           f'finding=~"{_any_of(CPU_STARVED_FINDINGS)}"}}) == 1\n'
           f"unless on (job_id, rank)\n(\n  {run_queue_above}\n"
           f"  < on (job_id, rank) ({CAUSE_SHARE} * {RANK_STRAGGLER_EXCESS})\n)")
    memory = (f'max by (job_id, rank) (dlprof_finding{{{_RANKED},'
              f'finding=~"{_any_of(MEMORY_PRESSURE_FINDINGS)}"}}) == 1')
    suspect = min(SUSPECT_STEP_SHARE, straggler_share)
    return [
        Record("Job throughput: samples per second over all its ranks, in steady state.",
               JOB_SAMPLES_RATE,
               'sum by (job_id) (rate(dlprof_samples_total{job_id!="",phase="steady"}'
               f"[{window}]))"),
        Record("Steady steps per second of each rank.",
               RANK_STEPS_RATE,
               f'sum by (job_id, rank) (rate(dlprof_steps_total{{{_RANKED},phase="steady"}}'
               f"[{window}]))"),
        Record("Mean step time of each rank; no series (not NaN) while it ends no step.",
               RANK_STEP_MEAN, _steps_counted(lambda over: (
                   f"sum by (job_id, rank) (rate(dlprof_step_duration_seconds_sum"
                   f"{{{_RANKED}}}[{over}]))\n/\n({steps(over)})"), window)),
        Record("Each phase's mean time per step of each rank: `exchange` is the wait in\n"
               "collectives, `other` the input (everything outside the model's steps).",
               RANK_PHASE_MEAN, _steps_counted(lambda over: (
                   f"sum by (job_id, rank, phase) (rate(dlprof_step_phase_seconds_total"
                   f"{{{_RANKED}}}[{over}]))\n/ on (job_id, rank) group_left ()\n"
                   f"({steps(over)})"), window)),
        Record("GPU time per step in collective (NCCL) kernels of each rank; no series for\n"
               "a job that runs none.",
               RANK_COLLECTIVE_MEAN, _steps_counted(lambda over: (
                   "sum by (job_id, rank) (rate(dlprof_collective_kernel_seconds_total"
                   f"{{{_RANKED}}}[{over}]))\n/ on (job_id, rank)\n({steps(over)})"), window)),
        Record("Each rank's wait for the others per step: its exchange phase, or its NCCL\n"
               "kernels' time where that is larger (an NCCL collective returns to the host\n"
               "once queued; the wait runs on the GPU). Kernels that overlap backward count\n"
               "on every rank alike, so ranks compare; see docs/fleet-exchange.md.",
               RANK_WAIT_MEAN,
               "max by (job_id, rank) (\n"
               f'  label_replace({RANK_PHASE_MEAN}{{phase="exchange"}}, '
               '"wait", "host", "", "")\n'
               f'  or label_replace({RANK_COLLECTIVE_MEAN}, "wait", "gpu", "", "")\n)'),
        Record("Own time per step: step time less the wait in collectives; the step time\n"
               "itself where the agent measures no exchange.",
               RANK_OWN_MEAN,
               f"{RANK_STEP_MEAN}\n  - on (job_id, rank) {RANK_WAIT_MEAN}\n"
               f"or {RANK_STEP_MEAN}"),
        Record("The job's median own time per step over its ranks.",
               JOB_OWN_MEDIAN, f"quantile by (job_id) (0.5, {RANK_OWN_MEAN})"),
        Record("The job's median step time over its ranks.",
               JOB_STEP_MEDIAN, f"quantile by (job_id) (0.5, {RANK_STEP_MEAN})"),
        Record("The job's median time per step of each phase over its ranks.",
               JOB_PHASE_MEDIAN, f"quantile by (job_id, phase) (0.5, {RANK_PHASE_MEAN})"),
        Record("How far each rank's own time per step is above the job's median\n"
               "(negative below it).",
               RANK_OWN_ABOVE_MEDIAN,
               f"{RANK_OWN_MEAN} - on (job_id) group_left () {JOB_OWN_MEDIAN}"),
        Record("How far each rank's time per step in each phase is above the job's median.",
               RANK_PHASE_ABOVE_MEDIAN,
               f"{RANK_PHASE_MEAN} - on (job_id, phase) group_left () {JOB_PHASE_MEDIAN}"),
        Record("Step skew: the slowest rank's own time over the median; 1 is balanced.",
               JOB_STEP_SKEW,
               f"max by (job_id) ({RANK_OWN_MEAN}) / ({JOB_OWN_MEDIAN} > 0)"),
        Record("Exchange share: the share of the ranks' step time spent waiting in\n"
               "collectives; no series where the agent measures no exchange.",
               JOB_EXCHANGE_SHARE,
               f'sum by (job_id) (rate(dlprof_step_phase_seconds_total{{{_RANKED},'
               f'phase="exchange"}}[{window}]))\n/\n'
               f"(sum by (job_id) (rate(dlprof_step_duration_seconds_sum{{{_RANKED}}}"
               f"[{window}])) > 0)"),
        Record("The least share of its step that any rank of the job spends waiting in\n"
               "collectives: what no rank of the job makes the others wait.",
               JOB_LEAST_WAIT_SHARE,
               f"min by (job_id) (\n  {RANK_WAIT_MEAN}\n"
               f"  / on (job_id, rank) ({RANK_STEP_MEAN} > 0)\n)"),
        Record("Scaling efficiency, estimated: the share of each step that the job's median\n"
               "rank spends on its own work (median own time over mean step time). The\n"
               "rest is waiting, for the slowest rank and for the exchange; 1 would be\n"
               "linear scaling. It counts a collective that overlaps backward as lost and\n"
               "knows nothing of the job's single-rank speed, so read it as an upper bound\n"
               "of what adding ranks loses, and compare it across runs of the same job.",
               JOB_SCALING_EFFICIENCY,
               f"{JOB_OWN_MEDIAN}\n"
               f"/ (avg by (job_id) ({RANK_STEP_MEAN}) > 0)\n"
               f"and on (job_id) {JOB_EXCHANGE_SHARE}"),
        Record("Ranks of each job whose process is up (dlprof_target_up 1).",
               JOB_RANKS_UP,
               f"count by (job_id) (group by (job_id, rank) (\n"
               f"  dlprof_target_info{{{_RANKED}}}\n"
               f"  and on (job, instance, pid) dlprof_target_up == 1))"),
        Record("Each job's world size, as its ranks report it.",
               JOB_WORLD_SIZE, 'max by (job_id) (dlprof_target_world_size{job_id!=""})'),
        Record("The time each rank's main thread waited in a run queue for a CPU per step;\n"
               "no series where the kernel keeps no schedstat.",
               RANK_RUN_QUEUE_MEAN, _steps_counted(lambda over: (
                   "sum by (job_id, rank) (\n"
                   f"  rate(dlprof_process_main_thread_run_queue_wait_seconds_total[{over}])\n"
                   "  * on (job, instance, pid) group_left (job_id, rank)\n"
                   "    group by (job, instance, pid, job_id, rank) "
                   f"(dlprof_target_info{{{_RANKED}}})\n)\n"
                   f"/ on (job_id, rank)\n({steps(over)})"), window)),
        Record("1 while a throttle reason that slows one GPU down holds any GPU the rank\n"
               "holds memory on; 0 while none does; no series without GPUs.",
               RANK_GPU_SLOWDOWN,
               "max by (job_id, rank) (\n"
               "  group by (job, instance, pid, gpu) (dlprof_process_gpu_memory_bytes > 0)\n"
               "  * on (job, instance, pid) group_left (job_id, rank)\n"
               f"    group by (job, instance, pid, job_id, rank) "
               f"(dlprof_target_info{{{_RANKED}}})\n"
               "  * on (job, instance, gpu) group_left ()\n"
               "    max by (job, instance, gpu) (dlprof_gpu_throttle_reason_active"
               f'{{reason=~"{_any_of(GPU_SLOWDOWN_REASONS)}"}})\n)'),
        Record("Stragglers: ranks whose own time per step is above the job's median by at\n"
               f"least {straggler_share:.0%} of the job's median step time (what the "
               "job loses to it) and\n"
               f"{STRAGGLER_FLOOR_SECONDS * 1000:g} ms; the value is the excess in seconds. "
               "A rank that waits in\ncollectives is not one: waiting is not own time.",
               RANK_STRAGGLER_EXCESS, _above_median_by(straggler_share)),
        Record("Each straggler with its cause, from its own signals: its input per step is\n"
               "above the job's median by most of its excess, and it does not stall on\n"
               "memory (input); a CPU finding on it,\n"
               "unless its main thread's run-queue wait per step is above the median by\n"
               "less than half its excess (cpu_starved); a slowdown on its GPUs\n"
               "(gpu_throttled); a memory finding (memory_pressure; a rank that stalls on\n"
               f"memory already at {suspect:.0%} above the median). Several may "
               "hold at once.\nWithout any of them: its forward, backward and optimizer time "
               "carry most of\nthe excess (compute), or nothing says (unknown).",
               RANK_STRAGGLER_CAUSE,
               "\nor\n".join([
                   _with_cause(input_excess, "input"),
                   _with_cause(cpu, "cpu_starved"),
                   _with_cause(f"{RANK_GPU_SLOWDOWN} == 1", "gpu_throttled"),
                   _with_cause(memory, "memory_pressure"),
                   # A rank that pages, at the suspects' bar: the straggler's is the
                   # healthy ranks' noise, and a healthy rank does not page. Its own
                   # side of each collective pages too, hiding part of its excess in
                   # everyone's wait (the benchmark's memory fault: the step 1.6x as
                   # long, the rank 13% of it above the median).
                   _with_cause(paging, "memory_pressure", _above_median_by(suspect)),
               ]) + "\nor on (job_id, rank)\n"
               + _with_cause(compute_excess, "compute")
               + "\nor on (job_id, rank)\n"
               f'label_replace({RANK_STRAGGLER_EXCESS}, "cause", "unknown", "", "")'),
    ]


def _above_median_by(share: float) -> str:
    """The ranks whose own time per step is above the job's median by ``share`` of the
    median step time and by the floor; the value is the excess in seconds."""
    return (f"({RANK_OWN_ABOVE_MEDIAN} >= {STRAGGLER_FLOOR_SECONDS})\n"
            f"and on (job_id, rank)\n"
            f"({RANK_OWN_ABOVE_MEDIAN}\n"
            f"  >= on (job_id) group_left () ({share} * {JOB_STEP_MEDIAN}))")


def _held(series: str, bar: float, duration: str) -> str:
    """``series >= bar`` at every evaluation over ``duration`` and present since its
    start: ``for: duration`` inside an expression, so that one alert can hold a lower
    bar longer than a higher one."""
    if duration_ms(duration) == 0:
        return f"{series} >= {bar}"
    return (f"min_over_time({series}[{duration}]) >= {bar}\n"
            f"and on (job_id) ({series} offset {duration})")


def job_alerts(window: str, for_: str, straggler_for: str = STRAGGLER_FOR,
               straggler_share: float = STRAGGLER_STEP_SHARE) -> list[Alert]:
    suspect = min(SUSPECT_STEP_SHARE, straggler_share)  # a straggler is a suspect too
    job = "job {{ $labels.job_id }}"
    return [
        Alert("A rank is slower than the rest of its job, which waits for it every step.",
              STRAGGLER_ALERT, RANK_STRAGGLER_CAUSE, straggler_for,
              (("severity", "warning"),),
              (("summary", f"rank {{{{ $labels.rank }}}} of {job} is a straggler "
                           "(cause: {{ $labels.cause }})"),
               ("description",
                "Its own time per step (step time less the wait in collectives) is "
                "{{ $value | humanizeDuration }} above the job's median, and every other "
                "rank waits that long for it each step. Cause input: it waits for data "
                "(more loader workers, prefetch); cpu_starved: its CPUs are oversubscribed "
                "or shared; gpu_throttled: a GPU of its slows down (cooling, power); "
                "memory_pressure: it swaps or nears its memory limit; compute: its own "
                "forward and backward are slower (another GPU model, a larger shard); "
                "unknown: none of its signals says."))),
        Alert("Every rank, even the one that waits least, spends a large share of its step\n"
              f"in collectives ({SLOW_EXCHANGE_FAST_SHARE:.0%}, or {SLOW_EXCHANGE_SHARE:.0%} "
              f"held for {for_}): the exchange itself is slow, not a rank. Which\n"
              "link or rank slows a collective cannot be told from the ranks' time split.\n"
              f"Not while a rank's own time is above the median by {suspect:.0%} of the step "
              "(a straggler\nor nearly one): it explains the others' wait, and its own side "
              "of each\n"
              "collective runs slow too (a starved rank's communication threads share its\n"
              "CPUs), so the rank, not the network, is the first suspect.",
              SLOW_EXCHANGE_ALERT,
              f"(\n  {JOB_LEAST_WAIT_SHARE} >= {SLOW_EXCHANGE_FAST_SHARE}\n  or "
              + _held(JOB_LEAST_WAIT_SHARE, SLOW_EXCHANGE_SHARE, for_).replace("\n", "\n  ")
              + "\n)\nunless on (job_id) (\n  "
              + _above_median_by(suspect).replace("\n", "\n  ") + "\n)",
              straggler_for, (("severity", "warning"), ("cause", "slow_collective")),
              (("summary", f"{job} spends {{{{ $value | humanizePercentage }}}} of each step "
                           "in collectives on its least-waiting rank"),
               ("description",
                "No rank makes the others wait this long: the collectives are slow. "
                "Overlap them with backward (DDP bucket_cap_mb), use larger batches per "
                "rank, or check the network between the nodes."))),
        Alert("Steps stopped while the job's processes are up: a hang (a dead peer in a\n"
              "collective, a deadlock, a stuck loader) or a long pause.",
              STALLED_ALERT,
              f'sum by (job_id) (increase(dlprof_steps_total{{job_id!=""}}[{window}])) == 0\n'
              'and on (job_id) sum by (job_id) (dlprof_steps_total{job_id!=""}) > 0\n'
              'and on (job_id) count by (job_id) (\n'
              '  dlprof_target_info{job_id!=""}\n'
              "  and on (job, instance, pid) dlprof_target_up == 1)",
              for_, (("severity", "critical"),),
              (("summary", f"{job} has made no step for {window}"),
               ("description",
                "Its processes are up but no rank ended a step. py-spy dump on a rank "
                "shows where it waits."))),
        Alert("Fewer ranks report than the job's world size: a node, its agent or a rank\n"
              "is gone. The value is how many are missing.",
              MISSING_RANKS_ALERT,
              f"{JOB_WORLD_SIZE} - on (job_id) {JOB_RANKS_UP} > 0",
              for_, (("severity", "warning"),),
              (("summary", f"{job} is missing {{{{ $value }}}} of its ranks"),
               ("description",
                "Compare the ranks on the job dashboard with the world size; a missing "
                "node's agent also raises DlprofAgentDown."))),
    ]


def agent_alerts(scrape_job: str, for_: str) -> list[Alert]:
    job = json.dumps(scrape_job)  # a PromQL string: the same escapes as JSON's
    return [
        Alert("Prometheus cannot scrape an agent: the node's figures stop.",
              AGENT_DOWN_ALERT, f"up{{job=~{job}}} == 0", for_,
              (("severity", "warning"),),
              (("summary", "dlprof-agent on {{ $labels.instance }} is down"),
               ("description",
                "Prometheus cannot scrape it. Check the agent's service (systemctl "
                "status dlprof-agent, or its DaemonSet pod) and the network."))),
        Alert("A target that is a rank of a job, or whose probe was up in the last hour,\n"
              "has no probe: its steps, phases and stragglers are not measured.",
              PROBE_DOWN_ALERT,
              "(\n"
              "  (dlprof_probe_up == 0)\n"
              "    * on (job, instance, pid) group_left (job_id, rank) dlprof_target_info\n"
              "  or on (job, instance, pid) (dlprof_probe_up == 0)\n"
              ")\n"
              "and on (job, instance, pid) (dlprof_target_up == 1)\n"
              "and on (job, instance, pid) (\n"
              f"  dlprof_target_info{{{_RANKED}}}\n"
              f"  or max_over_time(dlprof_probe_up[{PROBE_MEMORY}]) == 1)",
              for_, (("severity", "warning"),),
              (("summary", "no probe in pid {{ $labels.pid }} on {{ $labels.instance }}"),
               ("description",
                "The agent reads it from outside only. Its log says why, once (not Python, "
                "injection refused, --no-inject)."))),
    ]


def rules(options: RuleOptions) -> list[tuple[str, str, list[Rule]]]:
    """The groups of the file: (name, what it is, rules in evaluation order)."""
    return [
        ("dlprof", "What the overview, layers and threads dashboards read.",
         list(dashboard_rules())),
        ("dlprof-job",
         "Each job and its ranks (the job dashboard), and the job's alerts. Rules of a\n"
         "group run in order at one time, so each may read those above it.",
         [*job_rules(options.rate_window, options.straggler_share),
          *job_alerts(options.rate_window, options.for_, options.straggler_for,
                      options.straggler_share)]),
        ("dlprof-agents", "The agents and their probes.",
         list(agent_alerts(options.scrape_job, options.for_))),
    ]


# ---- The YAML text ---------------------------------------------------------------------

_PLAIN = re.compile(r"[A-Za-z0-9_.+-][^#\n]*")


def _scalar(text: str) -> str:
    """A one-line value, plain where YAML reads it back the same, else double-quoted."""
    if _PLAIN.fullmatch(text) and ": " not in text and not text.endswith(":"):
        return text
    return json.dumps(text, ensure_ascii=False)  # JSON strings are YAML double-quoted ones


def _comment(text: str, indent: str) -> list[str]:
    return [f"{indent}# {line}" for line in text.splitlines()]


def _expr(expr: str, indent: str) -> list[str]:
    if "\n" not in expr and _scalar(expr) == expr:
        return [f"{indent}expr: {expr}"]
    return [f"{indent}expr: |-", *(f"{indent}  {line}" for line in expr.splitlines())]


def _rule_lines(rule: Rule) -> list[str]:
    lines = _comment(rule.comment, "      ")
    if isinstance(rule, Record):
        return [*lines, f"      - record: {rule.name}", *_expr(rule.expr, "        ")]
    lines += [f"      - alert: {rule.name}", *_expr(rule.expr, "        "),
              f"        for: {rule.for_}", "        labels:"]
    lines += [f"          {key}: {_scalar(value)}" for key, value in rule.labels]
    lines.append("        annotations:")
    lines += [f"          {key}: {_scalar(value)}" for key, value in rule.annotations]
    return lines


def rules_file(options: RuleOptions) -> str:
    """The whole rules file for `rule_files:` in prometheus.yml."""
    command = f"dlprof-agent rules --rate-window {options.rate_window} --for {options.for_}"
    if options.straggler_for != STRAGGLER_FOR:
        command += f" --straggler-for {options.straggler_for}"
    if options.straggler_share != STRAGGLER_STEP_SHARE:
        command += f" --straggler-share {options.straggler_share:g}"
    if options.scrape_job != DEFAULT_SCRAPE_JOB:
        command += f" --scrape-job '{options.scrape_job}'"
    lines = [
        f"# Prometheus rules for dlprof-agent, written by `{command}`.",
        "# Regenerate rather than edit: tests keep the shipped copy and the command equal.",
        "# Recording rules follow Prometheus's level:metric:operations names. docs/fleet.md",
        "# explains the job's rules and the alerts.",
        "groups:",
    ]
    for name, about, group in rules(options):
        lines += _comment(about, "  ")
        lines += [f"  - name: {name}", "    rules:"]
        for rule in group:
            lines += _rule_lines(rule)
    return "\n".join(lines) + "\n"
