"""The findings rules on recorded and synthetic samples: each rule on and off,
the hysteresis that raises and clears them, and how they are exported and shown.
The GPU rules read kernel tables: the one recorded on an H100 (ResNet-50, fp32,
NCHW; tests/data/h100-resnet50) and synthetic ones."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dlprof_agent.agent.status import LiveStatus, Summary
from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.gpu_samples import GpuDeviceSample, GpuProcessSample, GpuSample
from dlprof_agent.collectors.host import HostSample
from dlprof_agent.collectors.limits import LimitsCollector, LimitsSample
from dlprof_agent.collectors.process import ProcessCollector, ProcessSample
from dlprof_agent.collectors.target import Target
from dlprof_agent.exporters.prometheus import NodeCollector
from dlprof_agent.model.findings import rules
from dlprof_agent.model.findings.catalogue import KINDS, KINDS_BY_ID, SEVERITIES, Finding
from dlprof_agent.model.findings.tracker import (
    CLEAR_AFTER_SECONDS,
    RAISE_AFTER_SECONDS,
    FindingsTracker,
)
from dlprof_agent.model.findings.window import MIN_WINDOW_SECONDS, WINDOW_SECONDS, Point, Window
from dlprof_agent.model.snapshot import AgentSelfSample, NodeSnapshot, Snapshot
from dlprof_agent.probe_link.samples import KernelRow, KernelSample, ProbeSample
from tests.conftest import agent_env

PID = 4242
H100 = Path(__file__).parent / "data" / "h100-resnet50"


# ---- building samples ------------------------------------------------------------------------


def host(*, cpus: int = 2, memory: int = 16 << 30, swap_in: int = 0,
         busy: float = 1.0) -> HostSample:
    return HostSample(cpu_seconds=(("user", busy), ("idle", 100.0)), logical_cpus=cpus,
                      physical_cpus=cpus,
                      memory_total_bytes=memory, memory_available_bytes=memory // 2,
                      swap_total_bytes=0, swap_used_bytes=0, swap_in_bytes=swap_in,
                      swap_out_bytes=0, load_average=(0.0, 0.0, 0.0))


def probe(*, steps: int = 0, step_seconds: float = 0.0,
          phases: Sequence[tuple[str, float]] = (), kernels: KernelSample | None = None,
          settings: Sequence[tuple[str, str]] = (), hook_errors: int = 0) -> ProbeSample:
    return ProbeSample(
        pid=PID, step_source="optimizer", steps=(("steady", steps), ("warmup", 10)),
        samples=(("steady", 32 * steps),), step_bucket_bounds=(1.0,),
        step_bucket_counts=(steps, 0), step_seconds_sum=step_seconds, last_step_seconds=None,
        phase_seconds=tuple(phases), layers=(), hook_errors=hook_errors, dropped_messages=(),
        settings=(("pytorch", tuple(settings)),), kernels=kernels)


def kernel_table(seconds: dict[str, float], *, state: str = "active", dropped: int = 0,
                 overhead: float = 0.0) -> KernelSample:
    return KernelSample(state=state, reason="",
                        kernels=tuple(KernelRow(name, 0, 10, s) for name, s in seconds.items()),
                        overhead_seconds=overhead, dropped_records=dropped, traced=True)


def gpu(*, utilization: float | None = 0.9, used: int = 10 << 30, total: int = 80 << 30,
        name: str = "NVIDIA H100 80GB HBM3") -> GpuSample:
    device = GpuDeviceSample(index=0, uuid="GPU-0", name=name, up=True,
                             utilization_ratio=utilization, memory_used_bytes=used,
                             memory_total_bytes=total)
    return GpuSample(available=True, devices=(device,),
                     processes=(GpuProcessSample(pid=PID, gpu_index=0, uuid="GPU-0",
                                                 memory_bytes=used,
                                                 sm_utilization_ratio=utilization),))


def point(seconds: float, *, user: float = 0.0, system: float = 0.0, iowait: float = 0.0,
          target_busy: float | None = None, involuntary: int = 0, runnable: int | None = 1,
          rss: int = 1 << 30, host_sample: HostSample | None = None,
          gpu_sample: GpuSample | None = None, limits: LimitsSample | None = None,
          probe_sample: ProbeSample | None = None, agent_cpu: float | None = None,
          main_wait: float | None = None, main_run: float | None = None) -> Point:
    return Point(seconds=seconds, user_seconds=user, system_seconds=system,
                 iowait_seconds=iowait,
                 target_busy_seconds=user + system if target_busy is None else target_busy,
                 involuntary_switches=involuntary, runnable_threads=runnable,
                 main_wait_seconds=main_wait, main_run_seconds=main_run, rss_bytes=rss,
                 host=host_sample or host(), gpu=gpu_sample, limits=limits,
                 probe=probe_sample, agent_cpu_seconds=agent_cpu, pids=frozenset({PID}))


def window(*points: Point) -> Window:
    return Window(tuple(points))


def limits(*, affinity: int | None = 2, quota: float | None = None,
           memory: int | None = None, stall: float | None = None) -> LimitsSample:
    return LimitsSample(affinity_cpus=affinity, cpu_quota_cores=quota,
                        memory_limit_bytes=memory, memory_usage_bytes=None,
                        memory_limit_hits=None, memory_stall_ratio=stall)


# ---- the recorded H100 run ---------------------------------------------------------------------


def _parse(path: Path) -> dict[str, list[tuple[dict[str, str], float]]]:
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            series.setdefault(sample.name, []).append((sample.labels, sample.value))
    return series


def recorded_point(path: Path) -> Point:
    """One scrape of the H100 run as the rules see a pass."""
    s = _parse(path)

    def one(name: str, **labels: str) -> float:
        return next(v for ls, v in s[name] if all(ls.get(k) == x for k, x in labels.items()))

    (info, _), = s["dlprof_framework_info"]
    settings = tuple((k, v) for k, v in info.items() if k != "pid")
    kernels = kernel_table({ls["kernel"]: v for ls, v in s["dlprof_kernel_seconds_total"]},
                           overhead=one("dlprof_cupti_overhead_seconds_total"))
    probe_sample = probe(
        steps=int(one("dlprof_steps_total", phase="steady")),
        step_seconds=one("dlprof_step_duration_seconds_sum"),
        phases=tuple((ls["phase"], v) for ls, v in s["dlprof_step_phase_seconds_total"]),
        kernels=kernels, settings=settings)
    (gpu_info, _), = s["dlprof_gpu_info"]
    sample = gpu(utilization=one("dlprof_gpu_utilization_ratio"),
                 used=int(one("dlprof_gpu_memory_used_bytes")),
                 total=int(one("dlprof_gpu_memory_total_bytes")), name=gpu_info["name"])
    sample = dataclasses.replace(sample, processes=(dataclasses.replace(
        sample.processes[0], pid=PID,
        sm_utilization_ratio=one("dlprof_process_gpu_sm_utilization_ratio")),))
    user, system = (one("dlprof_process_cpu_seconds_total", mode=m) for m in ("user", "system"))
    return point(one("dlprof_agent_last_sample_timestamp_seconds"), user=user, system=system,
                 involuntary=int(one("dlprof_process_context_switches_total",
                                     kind="involuntary")),
                 runnable=None, rss=int(one("dlprof_process_resident_memory_bytes")),
                 host_sample=host(cpus=int(one("dlprof_host_cpus", kind="logical")),
                                  memory=int(one("dlprof_host_memory_total_bytes"))),
                 gpu_sample=sample, probe_sample=probe_sample,
                 agent_cpu=one("dlprof_agent_cpu_seconds_total"))


@pytest.fixture(scope="module")
def h100() -> Window:
    """Scrapes m1 and m6 of the H100 run: 5 s of steady ResNet-50 steps."""
    return window(recorded_point(H100 / "m1.txt"), recorded_point(H100 / "m6.txt"))


def test_the_h100_run_has_the_layout_transposes_of_the_issue(h100: Window) -> None:
    check = rules.layout_transposes(h100)
    assert check is not None and check.holds
    # nchwToNhwcKernel and nhwcToNchwKernel: about 12% of GPU time, as measured there.
    assert 0.10 <= check.evidence["layout_kernel_ratio"] <= 0.14


def test_the_h100_run_has_autotuning_off_and_fp32_on_tensor_cores(h100: Window) -> None:
    autotune = rules.autotune_off(h100)
    assert autotune is not None and autotune.holds
    assert autotune.evidence["convolution_kernel_ratio"] >= rules.CONVOLUTION_SHARE
    fp32 = rules.fp32_on_tensor_cores(h100)
    assert fp32 is not None and fp32.holds
    assert fp32.evidence["tensor_cores"] == 1.0


def test_the_h100_run_is_neither_launch_nor_input_bound_nor_short_of_memory(
        h100: Window) -> None:
    # 75% SM share and 29% "other": a busy GPU, waiting on nothing in particular.
    for rule in (rules.launch_bound, rules.input_bound, rules.gpu_memory_near_total,
                 rules.memory_near_limit, rules.measurement_partial,
                 rules.measurement_costly):
        check = rule(h100)
        assert check is not None and not check.holds, (rule.__name__, check)
    assert rules.gradient_exchange(h100) is None  # one GPU, no NCCL: nothing to judge
    assert rules.thread_oversubscription(h100) is None  # runnable threads not recorded
    assert rules.cpu_contention(h100) is None


def test_the_h100_run_raised_through_the_tracker_once_the_causes_held() -> None:
    first, last = recorded_point(H100 / "m1.txt"), recorded_point(H100 / "m6.txt")
    tracker = FindingsTracker()
    assert tracker.update(first) == ()  # one pass is no window
    # The same rates go on: the last scrape repeated a little later, twice.
    step = last.seconds - first.seconds
    later = [_shifted(last, first, k * step) for k in (1, 2)]
    seen = [tracker.update(p) for p in (last, *later)]
    raised = {f.id for f in seen[-1] if f.active}
    assert raised == {"layout_transposes", "autotune_off", "fp32_on_tensor_cores"}
    assert not any(f.active for f in seen[0])  # held for one pass only: not yet


def _shifted(p: Point, origin: Point, dt: float) -> Point:
    """``p`` moved ``dt`` later, its counters grown at the rate they grew from ``origin``."""
    span = p.seconds - origin.seconds
    factor = 1 + dt / span

    def grown(now: float, then: float) -> float:
        return then + (now - then) * factor

    assert p.probe is not None and origin.probe is not None
    assert p.probe.kernels is not None and origin.probe.kernels is not None
    before = {r.kernel: r.seconds for r in origin.probe.kernels.kernels}
    kernels = dataclasses.replace(p.probe.kernels, kernels=tuple(
        dataclasses.replace(r, seconds=grown(r.seconds, before.get(r.kernel, 0.0)))
        for r in p.probe.kernels.kernels))
    phases_before = dict(origin.probe.phase_seconds)
    probe_sample = dataclasses.replace(
        p.probe, kernels=kernels,
        steps=(("steady", round(grown(p.probe.steady_steps, origin.probe.steady_steps))),),
        step_seconds_sum=grown(p.probe.step_seconds_sum, origin.probe.step_seconds_sum),
        phase_seconds=tuple((k, grown(v, phases_before[k])) for k, v in p.probe.phase_seconds))
    return dataclasses.replace(
        p, seconds=p.seconds + dt, user_seconds=grown(p.user_seconds, origin.user_seconds),
        system_seconds=grown(p.system_seconds, origin.system_seconds),
        target_busy_seconds=grown(p.target_busy_seconds, origin.target_busy_seconds),
        agent_cpu_seconds=grown(p.agent_cpu_seconds or 0.0, origin.agent_cpu_seconds or 0.0),
        probe=probe_sample)


# ---- GPU rules on synthetic kernel tables ------------------------------------------------------


def gpu_window(before: dict[str, float], after: dict[str, float], *,
               settings: Sequence[tuple[str, str]] = (("cudnn_autotune", "off"),
                                                       ("precision", "float32")),
               gpu_sample: GpuSample | None = None, busy: float = 0.2,
               steps: int = 10) -> Window:
    gpu_sample = gpu_sample or gpu()
    return window(
        point(0.0, gpu_sample=gpu_sample,
              probe_sample=probe(kernels=kernel_table(before), settings=settings)),
        point(2.0, user=2 * busy, gpu_sample=gpu_sample,
              probe_sample=probe(steps=steps, step_seconds=1.0, phases=(("optimizer", 0.1),),
                                 kernels=kernel_table(after), settings=settings)))


def test_layout_transposes_follow_their_share_of_gpu_time() -> None:
    def share(layout: float) -> bool:
        check = rules.layout_transposes(gpu_window(
            {}, {"cudnn::engines_precompiled::nchwToNhwcKernel": layout,
                 "sm90_xmma_fprop_implicit_gemm": 1.0 - layout}))
        assert check is not None
        return check.holds

    assert share(0.10) and not share(0.01)
    # Only what ran in the window counts: old transposes do not raise it.
    check = rules.layout_transposes(gpu_window({"nhwcToNchwKernel": 5.0},
                                               {"nhwcToNchwKernel": 5.0, "gemm": 1.0}))
    assert check is not None and not check.holds


def test_autotune_off_needs_convolutions_and_the_setting_off() -> None:
    convolutions = {"sm90_xmma_fprop_implicit_gemm_f32": 0.3, "sm90_xmma_wgrad_x": 0.2,
                    "at::native::vectorized_elementwise_kernel": 0.5}
    off = rules.autotune_off(gpu_window({}, convolutions))
    assert off is not None and off.holds
    on = rules.autotune_off(gpu_window({}, convolutions,
                                       settings=(("cudnn_autotune", "on"),)))
    assert on is not None and not on.holds
    few = rules.autotune_off(gpu_window({}, {"sm90_xmma_fprop_x": 0.05, "elementwise": 0.95}))
    assert few is not None and not few.holds
    assert rules.autotune_off(gpu_window({}, convolutions, settings=())) is None


def test_fp32_on_tensor_cores_needs_full_precision_a_tensor_core_gpu_and_matmuls() -> None:
    matmuls = {"sm90_xmma_gemm_f32f32_tf32f32": 0.6, "elementwise": 0.4}
    fp32 = rules.fp32_on_tensor_cores(gpu_window({}, matmuls))
    assert fp32 is not None and fp32.holds
    amp = rules.fp32_on_tensor_cores(gpu_window({}, matmuls,
                                                settings=(("precision", "amp_bfloat16"),)))
    assert amp is not None and not amp.holds
    pascal = rules.fp32_on_tensor_cores(gpu_window({}, matmuls,
                                                   gpu_sample=gpu(name="Tesla P100-PCIE-16GB")))
    assert pascal is not None and not pascal.holds
    elementwise = rules.fp32_on_tensor_cores(gpu_window({}, {"elementwise": 1.0}))
    assert elementwise is not None and not elementwise.holds


def test_launch_bound_is_an_idle_gpu_beside_a_busy_launcher() -> None:
    table = {"gemm": 1.0}
    launch = rules.launch_bound(gpu_window({}, table, gpu_sample=gpu(utilization=0.2),
                                           busy=1.0))
    assert launch is not None and launch.holds
    busy_gpu = rules.launch_bound(gpu_window({}, table, gpu_sample=gpu(utilization=0.9),
                                             busy=1.0))
    assert busy_gpu is not None and not busy_gpu.holds
    idle_host = rules.launch_bound(gpu_window({}, table, gpu_sample=gpu(utilization=0.2),
                                              busy=0.1))
    assert idle_host is not None and not idle_host.holds
    assert rules.launch_bound(window(point(0.0), point(2.0, user=2.0))) is None  # no GPU


def test_gradient_exchange_is_the_nccl_share_of_gpu_time() -> None:
    heavy = rules.gradient_exchange(gpu_window(
        {}, {"ncclDevKernel_AllReduce_Sum_f32_RING_LL": 0.3, "gemm": 0.7}))
    assert heavy is not None and heavy.holds
    assert heavy.evidence["exchange_seconds_per_step"] == pytest.approx(0.03)
    light = rules.gradient_exchange(gpu_window({}, {"ncclKernel_AllReduce": 0.05,
                                                    "gemm": 0.95}))
    assert light is not None and not light.holds
    assert rules.gradient_exchange(gpu_window({}, {"gemm": 1.0})) is None


def test_gpu_memory_near_total() -> None:
    full = rules.gpu_memory_near_total(gpu_window({}, {"gemm": 1.0},
                                                  gpu_sample=gpu(used=79 << 30)))
    assert full is not None and full.holds
    roomy = rules.gpu_memory_near_total(gpu_window({}, {"gemm": 1.0}))
    assert roomy is not None and not roomy.holds


# ---- outside signals ---------------------------------------------------------------------------


def test_oversubscription_counts_runnable_threads_against_affinity_and_quota() -> None:
    def over(runnable: int, limit: LimitsSample, involuntary: int = 600) -> bool:
        check = rules.thread_oversubscription(window(
            point(0.0, runnable=runnable, limits=limit),
            point(2.0, user=3.6, system=0.4, involuntary=involuntary, runnable=runnable,
                  limits=limit)))
        assert check is not None
        return check.holds

    assert over(6, limits(affinity=2))
    assert not over(2, limits(affinity=2))
    assert over(6, limits(affinity=16, quota=2.0))  # a container's quota binds too
    assert not over(6, limits(affinity=16))
    assert not over(6, limits(affinity=2), involuntary=4)  # nothing preempted: no contention


def test_cpu_contention_is_a_runnable_job_starved_on_a_busy_host() -> None:
    def starved(busy_cores: float, host_busy: float, runnable: int = 1) -> bool:
        check = rules.cpu_contention(window(
            point(0.0, runnable=runnable, host_sample=host(busy=0.0)),
            point(2.0, user=2 * busy_cores, runnable=runnable,
                  host_sample=host(busy=2 * 2 * host_busy))))
        assert check is not None
        return check.holds

    assert starved(busy_cores=0.1, host_busy=1.0)  # neighbours take both CPUs
    assert not starved(busy_cores=0.1, host_busy=0.3)  # a quiet host: something else
    assert not starved(busy_cores=0.9, host_busy=1.0)  # the job gets its core
    assert not starved(busy_cores=0.0, host_busy=1.0, runnable=0)  # it sleeps: not starved


def test_cpu_contention_is_also_a_main_thread_kept_waiting_for_its_cpu() -> None:
    """A rank pinned to a core it shares with busy threads, on a host whose other
    cores idle: its main thread waits in the run queue for most of its runnable time."""
    def check(wait: float, run: float, runnable: int | None = 1) -> rules.Check | None:
        return rules.cpu_contention(window(
            point(0.0, runnable=runnable, host_sample=host(busy=0.0), main_wait=10.0,
                  main_run=50.0),
            point(2.0, user=run, runnable=runnable, host_sample=host(busy=2 * 2 * 0.5),
                  main_wait=10.0 + wait, main_run=50.0 + run)))

    starved = check(wait=1.3, run=0.6)  # a third of a CPU while it wanted one
    assert starved is not None and starved.holds
    assert starved.evidence["main_thread_run_queue_wait_ratio"] == pytest.approx(1.3 / 1.9)
    assert starved.evidence["host_busy_ratio"] == pytest.approx(0.5)  # a half-idle host
    unknown_threads = check(wait=1.3, run=0.6, runnable=None)
    assert unknown_threads is not None and unknown_threads.holds
    fed = check(wait=0.1, run=1.8)  # its own core: 5% waiting
    assert fed is not None and not fed.holds
    shared = check(wait=0.6, run=1.0)  # beside one busy thread, after its sleeps
    assert shared is not None and shared.holds
    asleep = check(wait=0.15, run=0.1)  # runnable an eighth of the window: not judged
    assert asleep is not None and not asleep.holds
    assert "main_thread_run_queue_wait_ratio" not in asleep.evidence


def test_memory_near_limit_uses_the_cgroup_limit_else_the_host() -> None:
    near = rules.memory_near_limit(window(point(0.0), point(2.0, rss=950 << 20,
                                                            limits=limits(memory=1 << 30))))
    assert near is not None and near.holds
    assert near.evidence["limit_bytes"] == 1 << 30
    far = rules.memory_near_limit(window(point(0.0), point(2.0, rss=100 << 20,
                                                           limits=limits(memory=1 << 30))))
    assert far is not None and not far.holds
    host_only = rules.memory_near_limit(window(point(0.0), point(
        2.0, rss=15 << 30, host_sample=host(memory=16 << 30))))
    assert host_only is not None and host_only.holds


def test_memory_stalls_from_swap_in_pressure_or_iowait_near_the_limit() -> None:
    def stalls(**last: object) -> bool:
        check = rules.memory_stalls(window(point(0.0), point(2.0, **last)))  # type: ignore[arg-type]
        assert check is not None
        return check.holds

    assert stalls(host_sample=host(swap_in=10 << 20))
    assert stalls(limits=limits(stall=0.3))
    assert stalls(iowait=0.5, rss=900 << 20, limits=limits(memory=1 << 30))
    assert not stalls(iowait=0.5, rss=100 << 20, limits=limits(memory=1 << 30))  # just I/O
    assert not stalls()


# ---- probe signals -----------------------------------------------------------------------------


def steps_window(phases: Sequence[tuple[str, float]], *, user: float = 2.0,
                 runnable: int = 1, gpu_sample: GpuSample | None = None) -> Window:
    return window(point(0.0, runnable=runnable, gpu_sample=gpu_sample, probe_sample=probe()),
                  point(2.0, user=user, runnable=runnable, gpu_sample=gpu_sample,
                        probe_sample=probe(steps=20, step_seconds=2.0, phases=phases)))


def test_input_bound_from_the_other_share_with_layer_timing() -> None:
    slow_loader = rules.input_bound(steps_window((("forward", 0.3), ("backward", 0.3),
                                                  ("optimizer", 0.1), ("other", 1.3))))
    assert slow_loader is not None and slow_loader.holds
    assert slow_loader.evidence["other_step_ratio"] == pytest.approx(0.65)
    healthy = rules.input_bound(steps_window((("forward", 0.8), ("backward", 0.9),
                                              ("optimizer", 0.1), ("other", 0.2))))
    assert healthy is not None and not healthy.holds
    # A GPU busy in that time is not waiting for input, whatever the host does.
    busy_gpu = rules.input_bound(steps_window((("forward", 0.3), ("other", 1.7)),
                                              gpu_sample=gpu(utilization=0.95)))
    assert busy_gpu is not None and not busy_gpu.holds


def test_input_bound_without_layer_timing_is_a_host_that_sleeps() -> None:
    steps_only = (("optimizer", 0.1), ("other", 1.9))
    waits = rules.input_bound(steps_window(steps_only, user=0.2, runnable=0))
    assert waits is not None and waits.holds
    computes = rules.input_bound(steps_window(steps_only, user=2.0, runnable=1))
    assert computes is not None and not computes.holds
    # Little CPU with its thread runnable: starved by neighbours, not waiting for data.
    starved = rules.input_bound(steps_window(steps_only, user=0.2, runnable=1))
    assert starved is not None and not starved.holds
    # Too few steps in the window to judge.
    assert rules.input_bound(window(point(0.0, probe_sample=probe()),
                                    point(2.0, probe_sample=probe(steps=1, step_seconds=1.0))
                                    )) is None


def test_measurement_partial_and_costly() -> None:
    def partial(before: KernelSample, after: KernelSample, errors: int = 0) -> bool:
        check = rules.measurement_partial(window(
            point(0.0, probe_sample=probe(kernels=before)),
            point(2.0, probe_sample=probe(kernels=after, hook_errors=errors))))
        assert check is not None
        return check.holds

    quiet = kernel_table({"gemm": 1.0})
    assert not partial(quiet, quiet)
    assert partial(quiet, kernel_table({"gemm": 1.0}, state="busy"))
    assert partial(quiet, kernel_table({"gemm": 1.0}, dropped=100))
    assert partial(quiet, quiet, errors=3)
    costly = rules.measurement_costly(window(point(0.0, agent_cpu=1.0),
                                             point(2.0, agent_cpu=1.5)))
    assert costly is not None and costly.holds
    cheap = rules.measurement_costly(window(point(0.0, agent_cpu=1.0),
                                            point(2.0, agent_cpu=1.02)))
    assert cheap is not None and not cheap.holds
    cupti = rules.measurement_costly(window(
        point(0.0, agent_cpu=1.0, probe_sample=probe(kernels=quiet)),
        point(2.0, agent_cpu=1.0, probe_sample=probe(kernels=kernel_table({}, overhead=0.2)))))
    assert cupti is not None and cupti.holds


# ---- hysteresis ----------------------------------------------------------------------------------


def oversubscribed(seconds: float, runnable: int) -> Point:
    return point(seconds, user=1.8 * seconds, system=0.2 * seconds,
                 involuntary=int(500 * seconds), runnable=runnable, limits=limits(affinity=2))


def states(passes: Sequence[tuple[float, int]], tracker: FindingsTracker | None = None
           ) -> list[bool | None]:
    """thread_oversubscription after each pass (None: not judged)."""
    tracker = tracker or FindingsTracker()
    out: list[bool | None] = []
    for seconds, runnable in passes:
        found = {f.id: f for f in tracker.update(oversubscribed(seconds, runnable))}
        finding = found.get("thread_oversubscription")
        out.append(None if finding is None else finding.active)
    return out


def timeline(until: float, runnable: Sequence[tuple[float, int]]) -> list[tuple[float, int]]:
    """A pass every 0.5 s; runnable threads change at the given times."""
    passes = []
    t = 0.0
    while t <= until:
        passes.append((t, [r for start, r in runnable if start <= t][-1]))
        t += 0.5
    return passes


def test_a_cause_raises_its_finding_only_after_holding_and_clears_after_it_goes() -> None:
    passes = timeline(30.0, [(0.0, 8), (15.0, 1)])
    seen = states(passes)
    times = [t for t, _ in passes]
    assert seen[0] is None  # one sample: no window yet
    first_raised = times[seen.index(True)]
    # Judged from MIN_WINDOW_SECONDS on, raised RAISE_AFTER_SECONDS after that.
    assert MIN_WINDOW_SECONDS + RAISE_AFTER_SECONDS <= first_raised <= (
        MIN_WINDOW_SECONDS + RAISE_AFTER_SECONDS + 1.0)
    # From 15 s the window still holds oversubscribed samples for a few seconds; once
    # the cause is gone the finding stays up for CLEAR_AFTER_SECONDS, then clears.
    last_raised = max(t for t, s in zip(times, seen, strict=True) if s)
    assert 15.0 + CLEAR_AFTER_SECONDS <= last_raised <= 15.0 + WINDOW_SECONDS \
        + CLEAR_AFTER_SECONDS + 1.0
    assert seen[-1] is False


def test_a_brief_dip_neither_clears_nor_a_brief_spike_raises() -> None:
    # Oversubscribed, then 1 s of one thread, then oversubscribed again: stays raised.
    seen = states(timeline(20.0, [(0.0, 8), (12.0, 1), (13.0, 8)]))
    first = seen.index(True)
    assert all(seen[first:])
    # One thread, with 1 s of eight: never raised.
    assert True not in states(timeline(20.0, [(0.0, 1), (8.0, 8), (9.0, 1)]))


def test_another_process_starts_a_new_window() -> None:
    tracker = FindingsTracker()
    states(timeline(10.0, [(0.0, 8)]), tracker)
    other = dataclasses.replace(oversubscribed(10.5, 8), pids=frozenset({PID + 1}))
    assert tracker.update(other) == ()


# ---- export and display -----------------------------------------------------------------------


def finding(finding_id: str, active: bool, **evidence: float) -> Finding:
    return Finding(KINDS_BY_ID[finding_id], active, tuple(sorted(evidence.items())),
                   1.0 if active else None)


def snapshot_with(findings: tuple[Finding, ...], at: float = 100.0) -> Snapshot:
    process = ProcessSample(
        pid=PID, ppid=1, name="python", is_target=True, start_time_seconds=1.7e9,
        user_seconds=at, system_seconds=0.0, iowait_seconds=0.0, rss_bytes=1 << 30,
        vms_bytes=2 << 30, rss_peak_bytes=1 << 30, threads=9, thread_groups=(),
        voluntary_context_switches=0, involuntary_context_switches=0, read_bytes=None,
        write_bytes=None, read_chars=None, write_chars=None, open_fds=None,
        runnable_threads=8)
    return Snapshot(timestamp_seconds=1.7e9 + at, monotonic_seconds=at, target_pid=PID,
                    target_up=True, processes=(process,), agent=AgentSelfSample(1.0, 1, 1),
                    findings=findings)


def test_every_judged_rule_is_exported_1_when_raised_0_when_clear_with_its_evidence() -> None:
    snapshot = snapshot_with((
        finding("thread_oversubscription", True, runnable_threads=8.0, allowed_cpus=2.0),
        finding("memory_near_limit", False, resident_to_limit_ratio=0.1)))
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: NodeSnapshot.of_one(snapshot), interval_seconds=1.0))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"pid": str(PID), "job_id": "", "rank": "",
                                                **labels})

    assert value("dlprof_finding", finding="thread_oversubscription",
                 severity="warning") == 1
    assert value("dlprof_finding", finding="memory_near_limit", severity="critical") == 0
    assert value("dlprof_finding", finding="input_bound", severity="warning") is None
    assert value("dlprof_finding_evidence", finding="thread_oversubscription",
                 quantity="runnable_threads") == 8
    assert value("dlprof_finding_evidence", finding="memory_near_limit",
                 quantity="resident_to_limit_ratio") == 0.1


def test_live_status_names_the_raised_findings_and_the_summary_explains_them() -> None:
    raised = finding("thread_oversubscription", True, runnable_threads=4.2,
                     allowed_cpus=2.0, system_cpu_ratio=0.07)
    out = io.StringIO()
    status = LiveStatus(out)
    status.show(snapshot_with((raised, finding("memory_near_limit", False)), at=100.0))
    assert "findings: thread_oversubscription" in out.getvalue()
    assert "memory_near_limit" not in out.getvalue()

    summary = Summary()
    summary.add(snapshot_with((raised,), at=100.0))
    summary.add(snapshot_with((raised,), at=104.0))
    summary.add(snapshot_with((finding("thread_oversubscription", False),), at=110.0))
    text = summary.render(PID, target_exited=False)
    assert re.search(r"warning +thread_oversubscription \(held 4 s, cleared\)", text), text
    assert "evidence: allowed cpus 2, runnable threads 4.2, system cpu 7%" in text
    assert "try: lower the thread counts" in text
    (seen,) = summary.as_dict(PID)["findings"]
    assert seen["finding"] == "thread_oversubscription" and not seen["holding_at_end"]
    assert "findings     none" in _summary_of(snapshot_with(()))


def _summary_of(snapshot: Snapshot) -> str:
    summary = Summary()
    summary.add(snapshot)
    return summary.render(PID, target_exited=False)


def test_every_kind_has_a_known_severity_a_summary_and_advice() -> None:
    assert len(KINDS) == len(KINDS_BY_ID) >= 10
    for kind in KINDS:
        assert re.fullmatch(r"[a-z0-9_]+", kind.id)
        assert kind.severity in SEVERITIES
        assert kind.summary and kind.advice and "\n" not in kind.advice


def test_every_kind_of_the_catalogue_has_exactly_one_rule() -> None:
    assert set(rules.RULES) == set(KINDS_BY_ID)
    assert all(callable(rule) for rule in rules.RULES.values())


# ---- the limits collector and runnable threads on a real procfs ---------------------------


def fake_cgroup_tree(tmp_path: Path, version: str) -> tuple[str, str]:
    """(procfs, mounts file) for a process in /kubepods/job, with limits at two levels."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / str(PID)).mkdir(parents=True)
    mounts = tmp_path / "mounts"
    job = root / "kubepods" / "job"
    job.mkdir(parents=True)
    if version == "v2":
        (proc / str(PID) / "cgroup").write_text("0::/kubepods/job\n")
        mounts.write_text(f"cgroup2 {root} cgroup2 rw,nosuid 0 0\n")
        (root / "kubepods" / "cpu.max").write_text("400000 100000\n")
        (job / "cpu.max").write_text("150000 100000\n")
        (root / "kubepods" / "memory.max").write_text(f"{1 << 30}\n")
        (job / "memory.max").write_text("max\n")
        (job / "memory.current").write_text(f"{900 << 20}\n")
        (job / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 0\noom_kill 0\n")
        (job / "memory.pressure").write_text(
            "some avg10=12.50 avg60=3.00 avg300=1.00 total=100\n"
            "full avg10=1.00 avg60=0.00 avg300=0.00 total=10\n")
    else:
        (proc / str(PID) / "cgroup").write_text(
            "4:memory:/kubepods/job\n2:cpu,cpuacct:/kubepods/job\n0::/\n")
        memory, cpu = root / "memory", root / "cpu,cpuacct"
        for mount in (memory, cpu):
            (mount / "kubepods" / "job").mkdir(parents=True)
        mounts.write_text(f"cgroup {memory} cgroup rw,memory 0 0\n"
                          f"cgroup {cpu} cgroup rw,cpu,cpuacct 0 0\n")
        (memory / "kubepods" / "job" / "memory.limit_in_bytes").write_text(f"{1 << 30}\n")
        (memory / "memory.limit_in_bytes").write_text("9223372036854771712\n")
        (memory / "kubepods" / "job" / "memory.usage_in_bytes").write_text(f"{900 << 20}\n")
        (memory / "kubepods" / "job" / "memory.failcnt").write_text("7\n")
        (cpu / "kubepods" / "job" / "cpu.cfs_quota_us").write_text("150000\n")
        (cpu / "kubepods" / "job" / "cpu.cfs_period_us").write_text("100000\n")
        (cpu / "kubepods" / "cpu.cfs_quota_us").write_text("-1\n")
        (cpu / "kubepods" / "cpu.cfs_period_us").write_text("100000\n")
    return str(proc), str(mounts)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_limits_take_the_tightest_level_of_the_cgroup_and_the_affinity(
        tmp_path: Path, version: str) -> None:
    procfs, mounts = fake_cgroup_tree(tmp_path, version)
    sample = LimitsCollector(Target(PID, 0, procfs), mounts_file=mounts,
                             affinity=lambda pid: {0, 1, 2, 3}).sample()
    assert sample.affinity_cpus == 4
    assert sample.cpu_quota_cores == 1.5
    assert sample.allowed_cpus == 1.5
    assert sample.memory_limit_bytes == 1 << 30
    assert sample.memory_usage_bytes == 900 << 20
    assert sample.memory_limit_hits == 7
    assert sample.memory_stall_ratio == (0.125 if version == "v2" else None)


def test_limits_without_cgroups_are_the_affinity_alone(tmp_path: Path) -> None:
    (tmp_path / str(PID)).mkdir()
    empty = tmp_path / "mounts"
    empty.write_text("")
    sample = LimitsCollector(Target(PID, 0, str(tmp_path)), mounts_file=str(empty),
                             affinity=lambda pid: {0}).sample()
    assert (sample.allowed_cpus, sample.memory_limit_bytes) == (1, None)


def test_limits_of_this_process_match_its_affinity() -> None:
    sample = LimitsCollector(Target.of(os.getpid())).sample()
    assert sample.affinity_cpus == len(os.sched_getaffinity(0))


@pytest.fixture
def spinning() -> Iterator[subprocess.Popen[bytes]]:
    job = subprocess.Popen([sys.executable, "-m", "dlprof_agent.workloads.busy", "--threads",
                            "3", "--seconds", "30"], env=agent_env(), stdout=subprocess.PIPE)
    assert job.stdout is not None
    job.stdout.readline()
    yield job
    job.kill()
    job.wait(10)


def test_runnable_threads_count_the_threads_that_compute(
        spinning: subprocess.Popen[bytes]) -> None:
    collector = ProcessCollector(Target.of(spinning.pid), errors=ErrorLog(("process",)))
    counts = []
    for _ in range(10):
        # Its own sample: a child it starts for a moment (ldconfig) has one too.
        sample = next(s for s in collector.sample() if s.pid == spinning.pid)
        counts.append(sample.runnable_threads)
        time.sleep(0.05)
    # Three hashing threads, runnable whether on a CPU or queued for one; the main
    # thread sleeps.
    assert all(c is not None and c <= 4 for c in counts), counts
    assert max(c or 0 for c in counts) >= 2, counts


@pytest.mark.slow  # a timing window: the findings' window
def test_the_agent_judges_on_its_own_passes_and_a_scrape_only_renders_them(
        spinning: subprocess.Popen[bytes]) -> None:
    from dlprof_agent.agent.core import AgentOptions
    from dlprof_agent.agent.serve import make_agent
    from dlprof_agent.agent.snapshot_builder import target_snapshot

    agent = make_agent(Target.of(spinning.pid),
                       AgentOptions(interval=0.25, children=True, gpu=False))
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: agent.latest, interval_seconds=0.25))

    def latest() -> Snapshot:
        node = agent.latest
        assert node is not None
        return target_snapshot(node, spinning.pid)

    agent.sample_once()
    assert latest().findings == ()  # one pass: nothing to judge yet
    deadline = time.monotonic() + 3 * MIN_WINDOW_SECONDS
    while not latest().findings:
        assert time.monotonic() < deadline, "no rule judged the busy process"
        time.sleep(0.25)
        agent.sample_once()
    judged = {f.id for f in latest().findings}
    # Outside signals alone judge these, without a probe.
    assert {"thread_oversubscription", "memory_near_limit", "memory_stalls"} <= judged
    identity = latest().identity
    assert identity is not None
    labels = {"pid": str(spinning.pid), "job_id": identity.job_id, "rank": identity.rank,
              "finding": "memory_near_limit", "severity": "critical"}
    assert registry.get_sample_value("dlprof_finding", labels) == 0
    node = agent.latest
    registry.get_sample_value("dlprof_finding", labels)
    assert agent.latest is node  # scraping sampled nothing
