"""The GPU devices dashboard, and the GPU panels the overview shares."""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import timeseries

from dlprof_agent.grafana.panels import (
    ANY_ERROR,
    DEVICE,
    GPU_BUSY,
    JOB,
    PROCESS_DEVICE,
    TEMPERATURE,
    Panel,
    dashboard,
    stat_panel,
    time_series,
    value_states,
)

GPU_LEGEND = "{{instance}} GPU {{gpu}}"


def gpu_utilization(width: int) -> timeseries.Panel:
    return time_series(
        "GPU utilization",
        "Share of time a kernel ran, not how full the SMs were. Red: the GPU mostly waits "
        "on the CPU, the input pipeline or communication; dips between steps say the same.",
        "percentunit", [(f"dlprof_gpu_utilization_ratio{{{DEVICE}}}", GPU_LEGEND)],
        width=width, steps=GPU_BUSY)


def gpu_memory(width: int) -> timeseries.Panel:
    return time_series(
        "GPU memory used vs total",
        "Used close to total risks out-of-memory errors; far below leaves room for a "
        "larger batch.",
        "bytes",
        [(f"dlprof_gpu_memory_used_bytes{{{DEVICE}}}", f"{GPU_LEGEND} used"),
         (f"dlprof_gpu_memory_total_bytes{{{DEVICE}}}", f"{GPU_LEGEND} total")],
        width=width)


def process_gpu_memory(width: int) -> timeseries.Panel:
    return time_series(
        "GPU memory per process",
        "Which process holds device memory. A data-loader worker here has initialised "
        "CUDA, which is usually a mistake: keep CUDA calls out of the dataset.",
        "bytes",
        [(f"sum by (pid, gpu) (dlprof_process_gpu_memory_bytes{{{PROCESS_DEVICE}}})",
          "pid {{pid}} GPU {{gpu}}")],
        width=width)


# ---- GPU devices --------------------------------------------------------------------


def _device_stats() -> list[Panel]:
    return [
        stat_panel("NVML", "Whether the agent reads GPUs. 'no GPU' means no NVIDIA driver or "
                   "the agent was installed without the `gpu` extra.",
                   "short", f"min(dlprof_gpu_available{{{JOB}}})",
                   mappings=value_states(("0", "no GPU", "orange"), ("1", "reading", "green"))),
        stat_panel("GPUs", "Devices the agent sees on the selected hosts. Fewer than installed: "
                   "check CUDA_VISIBLE_DEVICES and the container's device list.", "short",
                   f"count(dlprof_gpu_info{{{DEVICE}}})"),
        stat_panel("GPUs lost", "Devices NVML can no longer read (fallen off the bus, Xid "
                   "errors). Above 0 (red) check `nvidia-smi` and the kernel log.", "short",
                   f"count(dlprof_gpu_up{{{DEVICE}}} == 0) "
                   f"or (0 * count(dlprof_gpu_up{{{DEVICE}}}))",
                   steps=ANY_ERROR),
        stat_panel("Mean utilization", "Mean share of time a kernel ran. Red under 50%: the GPUs "
                   "wait for the CPU or input.", "percentunit",
                   f"avg(dlprof_gpu_utilization_ratio{{{DEVICE}}})", steps=GPU_BUSY),
        stat_panel("Fullest GPU memory", "Used share of the fullest GPU. Above 90% amber, 97% red: "
                   "an allocation spike will fail.", "percentunit",
                   f"max(dlprof_gpu_memory_used_bytes{{{DEVICE}}} / "
                   f"dlprof_gpu_memory_total_bytes{{{DEVICE}}})",
                   steps=((None, "green"), (0.9, "orange"), (0.97, "red"))),
        stat_panel("Hottest GPU", "Highest die temperature. Above 80 °C amber, 90 °C red: "
                   "clocks drop soon; check cooling.", "celsius",
                   f"max(dlprof_gpu_temperature_celsius{{{DEVICE}}})", steps=TEMPERATURE),
    ]



def _device_load() -> list[Panel]:
    return [
        gpu_utilization(12),
        time_series(
            "Memory-controller utilization",
            "Share of time device memory was read or written. Above 80% (amber) with "
            "full kernel time the model is memory-bound: lower precision or fuse ops.",
            "percentunit", [(f"dlprof_gpu_memory_utilization_ratio{{{DEVICE}}}", GPU_LEGEND)],
            width=12, steps=((None, "green"), (0.8, "orange"))),
        gpu_memory(12),
        time_series(
            "GPU memory used share",
            "Used over total per GPU. Above 90% (amber) the caching allocator has little "
            "room; above 97% (red) expect out-of-memory errors.",
            "percentunit",
            [(f"dlprof_gpu_memory_used_bytes{{{DEVICE}}} / dlprof_gpu_memory_total_bytes"
              f"{{{DEVICE}}}", GPU_LEGEND)],
            width=12, steps=((None, "green"), (0.9, "orange"), (0.97, "red"))),
    ]


def _device_health() -> list[Panel]:
    pcie = "dlprof_gpu_pcie_throughput_bytes_per_second"
    return [
        time_series(
            "PCIe throughput",
            "RX is host to device, TX device to host. Sustained RX during steps means "
            "data is copied every step: pin memory, prefetch, or keep it on the GPU.",
            "Bps",
            [(f'{pcie}{{{DEVICE},direction="rx"}}', f"{GPU_LEGEND} RX"),
             (f'{pcie}{{{DEVICE},direction="tx"}}', f"{GPU_LEGEND} TX")],
            width=12),
        time_series(
            "Power",
            "Draw against the enforced limit. Draw pinned at the limit means the GPU is "
            "power capped; see the throttle reasons.",
            "watt",
            [(f"dlprof_gpu_power_watts{{{DEVICE}}}", f"{GPU_LEGEND} draw"),
             (f"dlprof_gpu_power_limit_watts{{{DEVICE}}}", f"{GPU_LEGEND} limit")],
            width=12),
        time_series(
            "Clocks",
            "SM and memory clocks. Clocks dropping under load mean power or thermal "
            "throttling: check power and temperature.",
            "hertz", [(f"dlprof_gpu_clock_hertz{{{DEVICE}}}", f"{GPU_LEGEND} {{{{clock}}}}")]),
        time_series(
            "Throttle reasons",
            "Each line is a reason holding the clocks down. sw_power_cap under full load "
            "is common; hw_slowdown or thermal reasons point to cooling or power supply.",
            "short",
            [(f"dlprof_gpu_throttle_reason_active{{{DEVICE}}} > 0",
              f"{GPU_LEGEND} {{{{reason}}}}")]),
        time_series(
            "Temperature",
            "Die temperature. Above 80 °C (amber) throttling is near; above 90 °C (red) "
            "check airflow and fans.",
            "celsius", [(f"dlprof_gpu_temperature_celsius{{{DEVICE}}}", GPU_LEGEND)],
            steps=TEMPERATURE),
    ]


def _device_processes() -> list[Panel]:
    return [
        process_gpu_memory(8),
        time_series(
            "SM share per process",
            "Each process's share of time with a kernel on the SMs. Processes sharing a "
            "GPU compete for it; low (red) for the training process means it waits.",
            "percentunit",
            [(f"sum by (pid, gpu) (dlprof_process_gpu_sm_utilization_ratio{{{PROCESS_DEVICE}}})",
              "pid {{pid}} GPU {{gpu}}")],
            steps=GPU_BUSY),
        time_series(
            "Memory-controller share per process",
            "Each process's share of time reading or writing device memory. High with a "
            "low SM share means the process is memory-bound.",
            "percentunit",
            [("sum by (pid, gpu) (dlprof_process_gpu_memory_utilization_ratio"
              f"{{{PROCESS_DEVICE}}})", "pid {{pid}} GPU {{gpu}}")],
            steps=((None, "green"), (0.8, "orange"))),
    ]


def build_gpu() -> dict[str, Any]:
    """Per-GPU utilization, memory, PCIe, power, clocks and temperature as a JSON model."""
    return dashboard(
        "dlprof-gpu", "dlprof-agent: GPU devices",
        "Each GPU's utilization, memory, PCIe, power, clocks and temperature, and each "
        "process's share of it, from NVML.",
        [("Devices", _device_stats()), ("Load and memory", _device_load()),
         ("PCIe, power and clocks", _device_health()), ("Processes", _device_processes())],
        gpu=True)
