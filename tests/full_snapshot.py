"""A snapshot with every field filled in, so every metric family has series."""

from __future__ import annotations

import dataclasses
import time

from dlprof_agent.collectors.gpu_samples import GpuDeviceSample, GpuProcessSample, GpuSample
from dlprof_agent.collectors.host import HostSample
from dlprof_agent.collectors.identity import Identity
from dlprof_agent.collectors.process import ProcessSample
from dlprof_agent.collectors.threads import ThreadGroupSample
from dlprof_agent.model.findings.catalogue import KINDS_BY_ID, Finding
from dlprof_agent.model.snapshot import AgentSelfSample, Snapshot
from dlprof_agent.probe_link.samples import (
    KernelDurations,
    KernelRow,
    KernelSample,
    LayerGpuRow,
    LayerSample,
    MemcpyRow,
    ProbeSample,
)


def full_snapshot(pid: int = 4242) -> Snapshot:
    process = ProcessSample(
        pid=pid, ppid=1, name="python", is_target=True, start_time_seconds=1.7e9,
        user_seconds=12.5, system_seconds=1.5, iowait_seconds=0.25,
        rss_bytes=2 << 30, vms_bytes=8 << 30, rss_peak_bytes=3 << 30, threads=3,
        thread_groups=(ThreadGroupSample("pt_main_thread", 1, 10.0, 1.0, 0.25),
                       ThreadGroupSample("python", 2, 2.5, 0.5, 0.0)),
        voluntary_context_switches=100, involuntary_context_switches=7,
        read_bytes=4096, write_bytes=8192, read_chars=10_000, write_chars=20_000, open_fds=12,
        runnable_threads=2, main_thread_wait_seconds=0.5, main_thread_run_seconds=11.0)
    child = dataclasses.replace(process, pid=pid + 1, ppid=pid, is_target=False)
    host = HostSample(
        cpu_seconds=(("user", 100.0), ("system", 20.0), ("idle", 500.0), ("iowait", 3.0)),
        logical_cpus=16, physical_cpus=8, memory_total_bytes=64 << 30,
        memory_available_bytes=32 << 30, swap_total_bytes=8 << 30, swap_used_bytes=1 << 30,
        swap_in_bytes=4096, swap_out_bytes=8192, load_average=(1.0, 2.0, 3.0))
    device = GpuDeviceSample(
        index=0, uuid="GPU-0000", name="NVIDIA H200", up=True, utilization_ratio=0.9,
        memory_utilization_ratio=0.4, memory_used_bytes=40 << 30, memory_total_bytes=141 << 30,
        pcie_tx_bytes_per_second=1e9, pcie_rx_bytes_per_second=2e9, power_watts=500.0,
        power_limit_watts=700.0, energy_joules=1e6, temperature_celsius=60.0,
        sm_clock_hertz=1.98e9, memory_clock_hertz=2.6e9,
        throttle_reasons=(("gpu_idle", False), ("sw_power_cap", True)))
    gpu = GpuSample(available=True, driver_version="570.00", devices=(device,),
                    processes=(GpuProcessSample(pid=pid, gpu_index=0, uuid="GPU-0000",
                                                memory_bytes=30 << 30,
                                                sm_utilization_ratio=0.8,
                                                memory_utilization_ratio=0.3),))
    probe = ProbeSample(
        pid=pid, step_source="optimizer", steps=(("steady", 20), ("warmup", 10)),
        samples=(("steady", 640), ("warmup", 320)), step_bucket_bounds=(0.1, 1.0),
        step_bucket_counts=(15, 5, 0), step_seconds_sum=4.0, last_step_seconds=0.2,
        phase_seconds=(("backward", 2.0), ("forward", 1.0), ("optimizer", 0.5),
                       ("other", 0.5)),
        layers=(LayerSample("features.0", 0.5, 20, 1.0, 20),), hook_errors=1,
        cpu_seconds=(("hooks", 0.01), ("thread", 0.02)),
        dropped_messages=(("malformed", 1),),
        settings=(("torch", (("framework", "pytorch"), ("framework_version", "2.13.0"))),),
        kernels=KernelSample(
            state="active", reason="", since=1_795_000_000.0,
            kernels=(KernelRow("at::native::vectorized_elementwise_kernel", 0, 100, 0.002),
                     KernelRow("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 10, 0.003),
                     KernelRow("other", 0, 5, 0.0001)),
            duration_bucket_bounds=(1e-05, 0.001), durations=(KernelDurations(0, (60, 45, 0),
                                                                               0.0021),),
            memcpy=(MemcpyRow(0, "h2d", 1 << 20, 0.0001),),
            layers=(LayerGpuRow("features.0", "forward", 0.001),),
            overhead_seconds=0.0005, dropped_records=0, devices=((0, "GPU-0000"),),
            record_clock="native", record_clock_measured_by="records", record_ticks_per_ns=1.0,
            traced=True),
        layer_sampled_steps=4, phase_split="split")
    return Snapshot(timestamp_seconds=time.time(), monotonic_seconds=time.monotonic(),
                    target_pid=pid, target_up=True, processes=(process, child), host=host,
                    gpu=gpu, collector_errors=(("gpu", 1),), sample_duration_seconds=0.002,
                    samples_total=5, agent=AgentSelfSample(1.5, 30 << 20, 31 << 20),
                    series_dropped=(("agent_budget", 0), ("target_budget", 12)),
                    probe=probe, probe_up=True,
                    identity=Identity(job_id="4711", rank="0", local_rank="0", node_rank="0",
                                      world_size=2, node="node-0", role="rank"),
                    findings=(Finding(KINDS_BY_ID["thread_oversubscription"], False,
                                      (("allowed_cpus", 2.0), ("runnable_threads", 2.0))),))
