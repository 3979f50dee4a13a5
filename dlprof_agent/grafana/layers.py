"""The layers and kernels dashboard: per-layer and per-kernel time, copies, the tracer."""

from __future__ import annotations

from typing import Any

from dlprof_agent.exporters.prometheus_rules import KERNEL_RATE, LAYER_RATE
from dlprof_agent.grafana.panels import (
    ANY_ERROR,
    PROCESS,
    PROCESS_DEVICE,
    Panel,
    Query,
    dashboard,
    rate,
    stat_panel,
    time_series,
)

# ---- Layers and kernels -------------------------------------------------------------


def _layers() -> list[Panel]:
    def top(phase: str) -> Query:
        return (f'topk(10, avg by (layer) ({LAYER_RATE}{{{PROCESS},phase="{phase}"}}))',
                "{{layer}}")

    per_call = ("topk(10, sum by (layer, phase) ("
                + rate("dlprof_layer_seconds_total", PROCESS) + ") / sum by (layer, phase) ("
                + rate("dlprof_layer_calls_total", PROCESS) + "))")
    return [
        time_series(
            "Forward CPU time by layer",
            "The ten layers whose forward pass takes the most time, as a share of wall "
            "time per process. A cheap layer high here (normalization, activation) "
            "is worth fusing or compiling.",
            "percentunit", [top("forward")]),
        time_series(
            "Backward CPU time by layer",
            "The same for the backward pass. Backward far above twice the forward points "
            "to recomputation or an expensive custom gradient.",
            "percentunit", [top("backward")]),
        time_series(
            "Time per call",
            "Mean time of one call, by layer and phase. Much longer than its neighbours "
            "for a layer of similar size means a slow kernel or layout: try channels-last "
            "or another algorithm.",
            "s", [(per_call, "{{layer}} {{phase}}")]),
    ]


def _layer_gpu() -> list[Panel]:
    gpu_rate = "dlprof_layer_gpu_seconds_total"
    return [
        time_series(
            "GPU time by layer",
            "The ten layers whose kernels keep the GPU busiest, by phase, as a share of "
            "wall time. This, not the CPU time, is what to shrink on a GPU-bound job.",
            "percentunit",
            [(f"topk(10, avg by (layer, phase) ({rate(gpu_rate, PROCESS)}))",
              "{{layer}} {{phase}}")],
            width=12),
        time_series(
            "GPU time per CPU second by layer",
            "GPU time of a layer's kernels for each second of its CPU time. Below 1 (red "
            "under 0.5) the layer is bound by launching kernels: larger batches, fused "
            "ops, torch.compile or CUDA graphs.",
            "short",
            [(f"topk(10, sum by (layer) ({rate(gpu_rate, PROCESS)}) / sum by (layer) ("
              f"{rate('dlprof_layer_seconds_total', PROCESS)}))", "{{layer}}")],
            width=12, steps=((None, "red"), (0.5, "orange"), (1.0, "green"))),
    ]


def _kernels() -> list[Panel]:
    duration = rate("dlprof_kernel_duration_seconds_bucket", PROCESS_DEVICE)
    return [
        time_series(
            "Top kernels by time",
            "The ten kernels that keep each GPU busiest, over the last minute. One "
            "kernel dominating is the place to optimise; many small ones call for fusion.",
            "percentunit",
            [(f"topk(10, sum by (gpu, kernel) ({KERNEL_RATE}{{{PROCESS_DEVICE}}}))",
              "GPU {{gpu}} {{kernel}}")]),
        time_series(
            "Top kernels by launches",
            "The ten kernels launched most often. Thousands per second of a short kernel "
            "is launch overhead: fuse, batch, or capture the step in a CUDA graph.",
            "ops",
            [("topk(10, sum by (kernel) ("
              + rate("dlprof_kernel_launches_total", PROCESS_DEVICE) + "))", "{{kernel}}")]),
        time_series(
            "Kernel duration",
            "Median and 99th percentile kernel time per GPU. A median under 10 µs (red) "
            "means launch overhead dominates: the GPU idles between tiny kernels.",
            "s",
            [(f"histogram_quantile(0.5, sum by (le, gpu) ({duration}))", "GPU {{gpu}} p50"),
             (f"histogram_quantile(0.99, sum by (le, gpu) ({duration}))", "GPU {{gpu}} p99")],
            steps=((None, "red"), (1e-5, "orange"), (5e-5, "green"))),
    ]


def _memcpy() -> list[Panel]:
    by_kind = "sum by (gpu, kind) ({})"
    copied = by_kind.format(rate("dlprof_memcpy_bytes_total", PROCESS_DEVICE))
    copying = by_kind.format(rate("dlprof_memcpy_seconds_total", PROCESS_DEVICE))
    return [
        time_series(
            "Copy throughput",
            "Bytes copied per second by direction (h2d host to device, d2h, d2d, p2p). "
            "Steady h2d traffic every step means data is copied each step: keep it on "
            "the GPU or prefetch.",
            "Bps", [(copied, "GPU {{gpu}} {{kind}}")]),
        time_series(
            "Copy time",
            "Share of wall time spent copying, by direction. Above 10% (amber) copies "
            "hold up compute: overlap them (non_blocking with pinned memory) or copy less.",
            "percentunit", [(copying, "GPU {{gpu}} {{kind}}")],
            steps=((None, "green"), (0.1, "orange"), (0.25, "red"))),
        time_series(
            "Copy bandwidth",
            "Bytes per second while a copy runs. h2d or d2h far below the link's speed "
            "(red under 2 GB/s) means pageable memory: pin it (pin_memory=True).",
            "Bps", [(f"{copied} / {copying}", "GPU {{gpu}} {{kind}}")],
            steps=((None, "red"), (2e9, "orange"), (8e9, "green"))),
    ]


def _tracer() -> list[Panel]:
    return [
        time_series(
            "The probe's own CPU",
            "CPU the probe itself takes inside the job, as a share of one core, by part: "
            "hooks (its step and phase hooks), layers (what steps with timed layers add), "
            "thread (its replies and kernel records). As the probe measures it; above 1% "
            "(amber) turn --layers' budget down.",
            "percentunit",
            [(f"sum by (pid, part) ({rate('dlprof_probe_cpu_seconds_total', PROCESS)})",
              "{{pid}} {{part}}")],
            steps=((None, "green"), (0.01, "orange"), (0.05, "red"))),
        time_series(
            "CUPTI overhead",
            "Time the kernel tracer costs the job, as a share of wall time. Above 2% "
            "(amber) trace fewer activity kinds or for shorter windows.",
            "percentunit",
            [(f"sum by (pid) ({rate('dlprof_cupti_overhead_seconds_total', PROCESS)})",
              "{{pid}}")],
            steps=((None, "green"), (0.02, "orange"), (0.05, "red"))),
        time_series(
            "Dropped CUPTI records",
            "Activity records lost in the last 5 minutes because the buffers were full; "
            "above 0 (red) the kernel figures undercount: give the tracer larger buffers.",
            "short",
            [(f"sum by (pid) (increase(dlprof_cupti_dropped_records_total{{{PROCESS}}}[5m]))",
              "{{pid}}")], steps=ANY_ERROR),
        stat_panel(
            "Kernel tracing state",
            "Processes per tracer state. busy: another profiler (Nsight, DCGM profiling) "
            "holds CUPTI, so stop it; unavailable: no CUPTI in this driver or container.",
            "short", f"count by (state) (dlprof_kernel_tracing_state{{{PROCESS}}} == 1)",
            legend="{{state}}", width=8, height=8),
    ]


def build_layers() -> dict[str, Any]:
    """Per-layer and per-kernel time as a Grafana JSON model."""
    return dashboard(
        "dlprof-layers", "dlprof-agent: layers and kernels",
        "Per-layer CPU time from the in-process probe (--layers), and per-layer GPU time, "
        "kernels and memory copies from the CUPTI tracer.",
        [("Layers (CPU time)", _layers()), ("Layers (GPU time)", _layer_gpu()),
         ("Kernels", _kernels()), ("Memory copies", _memcpy()),
         ("The probe's own cost", _tracer())], gpu=True)
