"""The kernel tracer's snapshot, through the agent's typed sample, to the
Prometheus families the dashboards read."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dlprof_agent.collectors.gpu_samples import GpuSample
from dlprof_agent.errors import ProtocolError
from dlprof_agent.exporters.prometheus import NodeCollector
from dlprof_agent.model.snapshot import NodeSnapshot
from dlprof_agent.probe import kernel_tracer as kt
from dlprof_agent.probe_link.samples import (
    KernelDurations,
    KernelRow,
    KernelSample,
    LayerGpuRow,
    MemcpyRow,
    ProbeSample,
)
from tests.cupti_records import DTOH, HTOD, BufferBuilder
from tests.fake_cupti import FakeBinding, now_on_cupti_clock
from tests.full_snapshot import full_snapshot

PID = 4242


def reply(kernels: dict[str, Any] | None) -> dict[str, Any]:
    message: dict[str, Any] = {
        "ok": True, "settings": {}, "dropped": {},
        "probe": {"step_source": "optimizer", "steps": {"steady": 1}, "samples": {},
                  "step_buckets": [1.0], "step_bucket_counts": [1, 0], "step_seconds_sum": 0.1,
                  "last_step_seconds": 0.1, "phase_seconds": {}, "layers": [],
                  "hook_errors": 0}}
    if kernels is not None:
        message["kernels"] = kernels
    return message


def traced_snapshot() -> dict[str, Any]:
    """What a probe's snapshot reply carries after some GPU work, from a real tracer."""
    binding = FakeBinding()
    tracer = kt.KernelTracer(continuous=True, max_layers=512, binding_factory=lambda: binding,
                             cuda_check=lambda: True, profiler_check=lambda: "")
    tracer.set_layers(["conv"])
    tracer.tick()
    base = tracer.correlator.base
    t = now_on_cupti_clock() - 100_000  # work that just ended, on CUPTI's clock
    binding.deliver(BufferBuilder()
                    .external(1, base).api(1).kernel("ampere_sgemm_128x64_nn", t, t + 30_000,
                                                     correlation=1)
                    .kernel("ampere_sgemm_128x64_nn", t, t + 10_000, device=1)
                    .memcpy(HTOD, 1 << 20, t, t + 100_000).memcpy(DTOH, 4, t, t + 1_000)
                    .overhead(t, t + 2_000))
    binding.dropped = 7
    tracer.tick()
    snapshot: dict[str, Any] = dict(tracer.snapshot())
    tracer.stop()
    snapshot["devices"] = {"0": "GPU-aaaa", "1": "GPU-bbbb"}
    snapshot["since"] = 1_795_000_000.5
    return snapshot


def registry(probe: ProbeSample, *, nvml: tuple[tuple[int, str], ...] = ()) -> CollectorRegistry:
    snapshot = full_snapshot(PID)
    devices = tuple(dataclasses.replace(snapshot.gpu.devices[0], index=index, uuid=uuid)
                    for index, uuid in nvml) if snapshot.gpu else ()
    gpu = GpuSample(available=True, driver_version="570", devices=devices, processes=())
    snapshot = dataclasses.replace(snapshot, probe=probe, gpu=gpu if nvml else None)
    result = CollectorRegistry()
    result.register(NodeCollector(lambda: NodeSnapshot.of_one(snapshot), interval_seconds=1.0))
    return result


def test_the_tracers_totals_become_the_documented_families() -> None:
    probe = ProbeSample.from_reply(PID, reply(traced_snapshot()))
    assert probe.kernels is not None and probe.kernels.traced
    value = registry(probe, nvml=((3, "GPU-aaaa"),)).get_sample_value
    pid = str(PID)

    # GPU-aaaa is NVML's device 3; GPU-bbbb is unknown to NVML: its CUDA ordinal stays.
    gemm = {"pid": pid, "kernel": "ampere_sgemm_128x64_nn"}
    assert value("dlprof_kernel_seconds_total", {**gemm, "gpu": "3"}) == pytest.approx(30e-6)
    assert value("dlprof_kernel_launches_total", {**gemm, "gpu": "3"}) == 1
    assert value("dlprof_kernel_seconds_total", {**gemm, "gpu": "1"}) == pytest.approx(10e-6)
    assert value("dlprof_kernel_duration_seconds_count", {"pid": pid, "gpu": "3"}) == 1
    assert value("dlprof_kernel_duration_seconds_bucket",
                 {"pid": pid, "gpu": "3", "le": "2.5e-05"}) == 0
    assert value("dlprof_kernel_duration_seconds_bucket",
                 {"pid": pid, "gpu": "3", "le": "5e-05"}) == 1
    assert value("dlprof_kernel_duration_seconds_bucket",
                 {"pid": pid, "gpu": "3", "le": "+Inf"}) == 1
    assert value("dlprof_memcpy_bytes_total", {"pid": pid, "gpu": "3", "kind": "h2d"}) == 1 << 20
    assert value("dlprof_memcpy_seconds_total",
                 {"pid": pid, "gpu": "3", "kind": "d2h"}) == pytest.approx(1e-6)
    assert value("dlprof_layer_gpu_seconds_total",
                 {"pid": pid, "layer": "conv", "phase": "forward"}) == pytest.approx(30e-6)
    assert value("dlprof_cupti_overhead_seconds_total", {"pid": pid}) == pytest.approx(2e-6)
    assert value("dlprof_cupti_dropped_records_total", {"pid": pid}) == 7
    assert value("dlprof_kernel_tracing_state",
                 {"pid": pid, "state": "active", "reason": ""}) == 1
    assert value("dlprof_kernel_tracing_state",
                 {"pid": pid, "state": "busy", "reason": ""}) == 0
    assert value("dlprof_kernel_tracing_state_since_timestamp_seconds",
                 {"pid": pid}) == 1_795_000_000.5
    # The fake's records end near cuptiGetTimestamp: CUPTI's own clock, told by them.
    assert value("dlprof_cupti_record_clock_info",
                 {"pid": pid, "clock": "native", "measured_by": "records"}) == 1
    assert value("dlprof_cupti_record_clock_ticks_per_ns", {"pid": pid}) == 1
    assert value("dlprof_cupti_unmeasured_batches_total", {"pid": pid}) == 0


def test_a_record_clock_a_probe_would_not_send_is_refused() -> None:
    snapshot = {**traced_snapshot(),
                "record_clock": {"clock": "x" * 40, "measured_by": "", "ticks_per_ns": 1.0}}
    with pytest.raises(ProtocolError, match="record clock"):
        ProbeSample.from_reply(PID, reply(snapshot))


def test_a_tracer_that_never_ran_shows_its_state_and_reason_only() -> None:
    probe = ProbeSample.from_reply(PID, reply({"state": "unavailable",
                                               "reason": "no CUDA in use", "errors": 0}))
    exposition = generate_latest(registry(probe)).decode()
    families = {f.name: f for f in text_string_to_metric_families(exposition)}
    state = families["dlprof_kernel_tracing_state"]
    assert {(s.labels["state"], s.labels["reason"], s.value) for s in state.samples} == {
        ("active", "", 0), ("busy", "", 0), ("unavailable", "no CUDA in use", 1)}
    assert not [name for name in families if name.startswith(("dlprof_kernel_seconds",
                                                                "dlprof_memcpy", "dlprof_cupti"))]


def test_a_probe_older_than_kernel_tracing_has_no_kernel_series() -> None:
    probe = ProbeSample.from_reply(PID, reply(None))
    assert probe.kernels is None
    exposition = generate_latest(registry(probe)).decode()
    assert "dlprof_kernel" not in exposition


def test_the_dashboards_kernel_metrics_are_exported_with_exactly_their_labels() -> None:
    panels = pytest.importorskip("dlprof_agent.grafana.panels")
    probe = ProbeSample.from_reply(PID, reply(traced_snapshot()))
    exposition = generate_latest(registry(probe)).decode()
    exported = {}
    for family in text_string_to_metric_families(exposition):
        name = family.name + ("_total" if family.type == "counter" else "")
        exported[name] = {label for sample in family.samples for label in sample.labels
                          if label != "le"}
    for name, labels in panels.KERNEL_METRICS.items():
        assert exported[name] == set(labels), name


def test_the_sample_is_typed_and_immutable() -> None:
    sample = KernelSample.from_reply(traced_snapshot())
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.state = "busy"  # type: ignore[misc]
    assert sample.devices == ((0, "GPU-aaaa"), (1, "GPU-bbbb"))
    assert {row.kind for row in sample.memcpy} == {"h2d", "d2h"}
    # Each row is its frozen dataclass with its fields' types, not the reply's list,
    # and every sequence a tuple.
    families = ((sample.kernels, KernelRow), (sample.durations, KernelDurations),
                (sample.memcpy, MemcpyRow), (sample.layers, LayerGpuRow))
    for rows, row_type in families:
        assert type(rows) is tuple and rows, row_type.__name__
        for row in rows:
            assert type(row) is row_type
            hints = typing.get_type_hints(row_type)
            for field in dataclasses.fields(row_type):
                value, hint = getattr(row, field.name), hints[field.name]
                assert type(value) is typing.get_origin(hint) or type(value) is hint, field
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(rows[0], dataclasses.fields(row_type)[0].name, None)
    assert all(type(counts) is int for row in sample.durations for counts in row.bucket_counts)


def test_nccl_kernels_are_summed_per_rank_as_collective_gpu_time() -> None:
    """Kernels named as NCCL's releases name them (one kernel may run several
    operations, so the name says NCCL, not which call) are summed; others are not."""
    binding = FakeBinding()
    tracer = kt.KernelTracer(continuous=True, max_layers=512, binding_factory=lambda: binding,
                             cuda_check=lambda: True, profiler_check=lambda: "")
    tracer.tick()
    t = now_on_cupti_clock() - 100_000
    binding.deliver(BufferBuilder()
                    .kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", t, t + 40_000)
                    .kernel("ncclKernel_SendRecv_RING", t, t + 5_000)
                    .kernel("ampere_sgemm_128x64_nn", t, t + 30_000))
    tracer.tick()
    snapshot = dict(tracer.snapshot())
    tracer.stop()
    probe = ProbeSample.from_reply(PID, reply(snapshot))
    assert probe.kernels is not None
    assert probe.kernels.collective_seconds() == pytest.approx(45e-6)
    exported = [sample for metric in text_string_to_metric_families(
        generate_latest(registry(probe)).decode()) for sample in metric.samples
        if sample.name == "dlprof_collective_kernel_seconds_total"]
    assert len(exported) == 1 and exported[0].value == pytest.approx(45e-6)
    assert {"pid", "job_id", "rank"} == set(exported[0].labels)

    without = ProbeSample.from_reply(PID, reply(traced_snapshot()))  # a gemm, no NCCL
    assert without.kernels is not None and without.kernels.collective_seconds() is None
    names = {metric.name for metric in text_string_to_metric_families(
        generate_latest(registry(without)).decode()) if metric.samples}
    assert "dlprof_collective_kernel_seconds" not in names
