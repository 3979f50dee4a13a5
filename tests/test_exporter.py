"""The Prometheus contract: snapshots built by hand, read back from a fresh registry."""

from __future__ import annotations

import dataclasses
import errno
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dlprof_agent import __version__
from dlprof_agent.collectors.gpu_samples import GpuDeviceSample, GpuProcessSample, GpuSample
from dlprof_agent.collectors.host import HostSample
from dlprof_agent.collectors.identity import Identity
from dlprof_agent.collectors.process import ProcessSample
from dlprof_agent.collectors.threads import ThreadGroupSample
from dlprof_agent.exporters.http import MetricsServer
from dlprof_agent.exporters.prometheus import NodeCollector
from dlprof_agent.model.snapshot import NodeSnapshot, Snapshot
from dlprof_agent.probe_link.samples import LayerSample, ProbeSample
from tests.helpers import SCRAPE_TIMEOUT_SECONDS

PID = 4242


def process(pid: int = PID, **changes: Any) -> ProcessSample:
    sample = ProcessSample(
        pid=pid, ppid=1, name="python", is_target=True, start_time_seconds=1.7e9,
        user_seconds=12.5, system_seconds=1.5, iowait_seconds=0.25, rss_bytes=100 << 20,
        vms_bytes=1 << 30, rss_peak_bytes=200 << 20, threads=3,
        thread_groups=(ThreadGroupSample("python", 2, 10.0, 1.0, 0.25),
                       ThreadGroupSample("data loader", 1, 2.5, 0.5, 0.0)),
        voluntary_context_switches=100, involuntary_context_switches=7,
        read_bytes=4096, write_bytes=8192, read_chars=10_000, write_chars=20_000, open_fds=12,
        main_thread_wait_seconds=0.75, main_thread_run_seconds=11.0)
    return dataclasses.replace(sample, **changes)


HOST = HostSample(
    cpu_seconds=(("user", 100.0), ("system", 20.0), ("idle", 500.0), ("iowait", 3.0)),
    logical_cpus=16, physical_cpus=8, memory_total_bytes=64 << 30,
    memory_available_bytes=32 << 30, swap_total_bytes=8 << 30, swap_used_bytes=1 << 30,
    swap_in_bytes=4096, swap_out_bytes=8192, load_average=(1.0, 2.0, 3.0))

DEVICE = GpuDeviceSample(
    index=0, uuid="GPU-0000", name="NVIDIA H100", up=True, utilization_ratio=0.75,
    memory_utilization_ratio=0.5, memory_used_bytes=40 << 30, memory_total_bytes=80 << 30,
    pcie_tx_bytes_per_second=1.5e9, pcie_rx_bytes_per_second=2.5e9, power_watts=300.0,
    power_limit_watts=700.0, energy_joules=1e6, temperature_celsius=65.0,
    sm_clock_hertz=1.98e9, memory_clock_hertz=2.6e9,
    throttle_reasons=(("sw_power_cap", True), ("hw_slowdown", False)))

GPU = GpuSample(
    available=True, driver_version="550.54.15",
    devices=(DEVICE, dataclasses.replace(DEVICE, index=1, uuid="GPU-0001")),
    processes=(GpuProcessSample(pid=PID, gpu_index=0, uuid="GPU-0000", memory_bytes=10 << 30,
                                sm_utilization_ratio=0.6, memory_utilization_ratio=0.2),
               GpuProcessSample(pid=PID + 1, gpu_index=1, uuid="GPU-0001",
                                memory_bytes=None)))


def snapshot(**changes: Any) -> Snapshot:
    base = Snapshot(timestamp_seconds=1.7e9 + 100, monotonic_seconds=50.0, target_pid=PID,
                    target_up=True, processes=(process(),), host=HOST, gpu=GPU,
                    collector_errors=(("gpu", 3), ("process", 1)),
                    sample_duration_seconds=0.0125, samples_total=7)
    return dataclasses.replace(base, **changes)


def registry_for(snap: Snapshot | None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: None if snap is None else NodeSnapshot.of_one(snap),
                                    interval_seconds=1.0))
    return registry


def series_names(registry: CollectorRegistry) -> set[str]:
    return {sample.name for family in registry.collect() for sample in family.samples}


# --- the contract ------------------------------------------------------------------


def test_process_series() -> None:
    value = registry_for(snapshot()).get_sample_value
    pid = str(PID)
    assert value("dlprof_process_cpu_seconds_total", {"pid": pid, "mode": "user"}) == 12.5
    assert value("dlprof_process_cpu_seconds_total", {"pid": pid, "mode": "system"}) == 1.5
    assert value("dlprof_process_cpu_seconds_total", {"pid": pid, "mode": "iowait"}) == 0.25
    assert value("dlprof_thread_group_cpu_seconds_total",
                 {"pid": pid, "thread_name": "data loader", "mode": "user"}) == 2.5
    assert value("dlprof_thread_group_cpu_seconds_total",
                 {"pid": pid, "thread_name": "python", "mode": "iowait"}) == 0.25
    assert value("dlprof_thread_group_threads", {"pid": pid, "thread_name": "python"}) == 2
    assert value("dlprof_process_context_switches_total",
                 {"pid": pid, "kind": "voluntary"}) == 100
    assert value("dlprof_process_context_switches_total",
                 {"pid": pid, "kind": "involuntary"}) == 7
    assert value("dlprof_process_io_bytes_total", {"pid": pid, "direction": "read"}) == 4096
    assert value("dlprof_process_io_bytes_total", {"pid": pid, "direction": "write"}) == 8192
    assert value("dlprof_process_io_logical_bytes_total",
                 {"pid": pid, "direction": "write"}) == 20_000
    assert value("dlprof_process_resident_memory_bytes", {"pid": pid}) == 100 << 20
    assert value("dlprof_process_resident_memory_peak_bytes", {"pid": pid}) == 200 << 20
    assert value("dlprof_process_threads", {"pid": pid}) == 3
    assert value("dlprof_process_open_fds", {"pid": pid}) == 12
    assert value("dlprof_process_main_thread_run_queue_wait_seconds_total", {"pid": pid}) == 0.75
    assert value("dlprof_process_main_thread_run_seconds_total", {"pid": pid}) == 11.0
    assert value("dlprof_process_info",
                 {"pid": pid, "ppid": "1", "name": "python", "role": "target"}) == 1


def test_a_child_process_has_its_own_series_and_the_child_role() -> None:
    child = process(PID + 1, ppid=PID, is_target=False, user_seconds=3.0)
    value = registry_for(snapshot(processes=(process(), child))).get_sample_value
    assert value("dlprof_process_info", {"pid": str(PID + 1), "ppid": str(PID),
                                         "name": "python", "role": "child"}) == 1
    assert value("dlprof_process_cpu_seconds_total",
                 {"pid": str(PID + 1), "mode": "user"}) == 3.0
    assert value("dlprof_process_cpu_seconds_total", {"pid": str(PID), "mode": "user"}) == 12.5


def test_host_series() -> None:
    value = registry_for(snapshot()).get_sample_value
    assert value("dlprof_host_cpus", {"kind": "logical"}) == 16
    assert value("dlprof_host_cpus", {"kind": "physical"}) == 8
    assert value("dlprof_host_cpu_seconds_total", {"mode": "idle"}) == 500
    assert value("dlprof_host_memory_total_bytes") == 64 << 30
    assert value("dlprof_host_memory_available_bytes") == 32 << 30
    assert value("dlprof_host_swap_io_bytes_total", {"direction": "out"}) == 8192
    assert value("dlprof_host_load_average", {"window": "15m"}) == 3.0

    unknown_cores = dataclasses.replace(HOST, physical_cpus=None)
    value = registry_for(snapshot(host=unknown_cores)).get_sample_value
    assert value("dlprof_host_cpus", {"kind": "logical"}) == 16
    assert value("dlprof_host_cpus", {"kind": "physical"}) is None


def test_no_host_sample_means_no_host_series() -> None:
    names = series_names(registry_for(snapshot(host=None)))
    assert not {name for name in names if name.startswith("dlprof_host_")}
    assert "dlprof_process_threads" in names


def test_gpu_series() -> None:
    value = registry_for(snapshot()).get_sample_value
    assert value("dlprof_gpu_available") == 1
    device = {"gpu": "1", "uuid": "GPU-0001"}
    assert value("dlprof_gpu_pcie_throughput_bytes_per_second",
                 {**device, "direction": "tx"}) == 1.5e9
    assert value("dlprof_gpu_pcie_throughput_bytes_per_second",
                 {**device, "direction": "rx"}) == 2.5e9
    assert value("dlprof_gpu_utilization_ratio", device) == 0.75
    assert value("dlprof_gpu_memory_used_bytes", device) == 40 << 30
    assert value("dlprof_gpu_energy_joules_total", device) == 1e6
    assert value("dlprof_gpu_clock_hertz", {**device, "clock": "sm"}) == 1.98e9
    assert value("dlprof_gpu_throttle_reason_active", {**device, "reason": "sw_power_cap"}) == 1
    assert value("dlprof_gpu_throttle_reason_active", {**device, "reason": "hw_slowdown"}) == 0
    assert value("dlprof_gpu_up", device) == 1
    assert value("dlprof_gpu_info", {**device, "name": "NVIDIA H100",
                                     "driver_version": "550.54.15"}) == 1
    assert value("dlprof_process_gpu_memory_bytes", {"pid": str(PID), "gpu": "0"}) == 10 << 30
    assert value("dlprof_process_gpu_sm_utilization_ratio",
                 {"pid": str(PID), "gpu": "0"}) == 0.6
    # Process PID+1 on gpu 1 has no memory reading: no series, not 0 and not NaN.
    assert value("dlprof_process_gpu_memory_bytes", {"pid": str(PID + 1), "gpu": "1"}) is None


def test_agent_series() -> None:
    value = registry_for(snapshot()).get_sample_value
    assert value("dlprof_target_up", {"pid": str(PID)}) == 1
    assert value("dlprof_collector_errors_total", {"collector": "gpu"}) == 3
    assert value("dlprof_collector_errors_total", {"collector": "process"}) == 1
    assert value("dlprof_agent_samples_total") == 7
    assert value("dlprof_agent_interval_seconds") == 1.0
    assert value("dlprof_agent_info", {"version": __version__}) == 1

    gone = registry_for(snapshot(target_up=False, processes=())).get_sample_value
    assert gone("dlprof_target_up", {"pid": str(PID)}) == 0


def test_before_the_first_sample_only_the_agent_describes_itself() -> None:
    registry = registry_for(None)
    assert registry.get_sample_value("dlprof_agent_info", {"version": __version__}) == 1
    names = series_names(registry)
    assert "dlprof_target_up" not in names
    assert not {name for name in names if name.startswith(("dlprof_process_", "dlprof_gpu_"))}


def test_registering_does_not_render_a_snapshot() -> None:
    def latest() -> NodeSnapshot | None:
        raise AssertionError("collect() was called at registration")

    CollectorRegistry().register(NodeCollector(latest, interval_seconds=1.0))


# --- missing data ------------------------------------------------------------------


def test_none_fields_produce_no_series_and_never_nan() -> None:
    bare_process = process(read_bytes=None, write_bytes=None, read_chars=None,
                           write_chars=4096, open_fds=None)
    bare_device = GpuDeviceSample(index=0, uuid="GPU-0000", name="NVIDIA H100", up=True)
    gpu = GpuSample(available=True, driver_version=None, devices=(bare_device,),
                    processes=(GpuProcessSample(pid=PID, gpu_index=0, uuid="GPU-0000"),))
    registry = registry_for(snapshot(processes=(bare_process,), gpu=gpu))

    names = series_names(registry)
    for family in ("dlprof_process_io_bytes_total", "dlprof_process_io_logical_bytes_total",
                   "dlprof_process_open_fds", "dlprof_gpu_utilization_ratio",
                   "dlprof_gpu_memory_used_bytes", "dlprof_gpu_power_watts",
                   "dlprof_gpu_energy_joules_total", "dlprof_gpu_pcie_throughput_bytes_per_second",
                   "dlprof_gpu_clock_hertz", "dlprof_gpu_throttle_reason_active",
                   "dlprof_process_gpu_memory_bytes",
                   "dlprof_process_gpu_sm_utilization_ratio"):
        assert family not in names, family
    # What is known is still there.
    value = registry.get_sample_value
    assert value("dlprof_gpu_up", {"gpu": "0", "uuid": "GPU-0000"}) == 1
    assert value("dlprof_gpu_info", {"gpu": "0", "uuid": "GPU-0000", "name": "NVIDIA H100",
                                     "driver_version": ""}) == 1
    assert value("dlprof_process_threads", {"pid": str(PID)}) == 3
    assert "nan" not in generate_latest(registry).decode().lower()


def test_a_lost_gpu_is_down_with_no_readings() -> None:
    lost = GpuDeviceSample(index=1, uuid="GPU-0001", name="NVIDIA H100", up=False)
    gpu = dataclasses.replace(GPU, devices=(DEVICE, lost))
    value = registry_for(snapshot(gpu=gpu)).get_sample_value
    assert value("dlprof_gpu_up", {"gpu": "1", "uuid": "GPU-0001"}) == 0
    assert value("dlprof_gpu_utilization_ratio", {"gpu": "1", "uuid": "GPU-0001"}) is None
    assert value("dlprof_gpu_up", {"gpu": "0", "uuid": "GPU-0000"}) == 1


@pytest.mark.parametrize("gpu", [None, GpuSample(available=False),
                                 dataclasses.replace(GPU, available=False)],
                         ids=["no-collector", "unavailable", "unavailable-with-stale-devices"])
def test_without_gpus_only_gpu_available_0(gpu: GpuSample | None) -> None:
    registry = registry_for(snapshot(gpu=gpu))
    assert registry.get_sample_value("dlprof_gpu_available") == 0
    names = series_names(registry)
    assert {n for n in names if n.startswith("dlprof_gpu_")} == {"dlprof_gpu_available"}
    assert not {n for n in names if n.startswith("dlprof_process_gpu_")}


def test_a_process_that_is_gone_from_the_snapshot_loses_its_series() -> None:
    child = process(PID + 1, ppid=PID, is_target=False)
    current = [snapshot(processes=(process(), child))]
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: NodeSnapshot.of_one(current[0]), interval_seconds=1.0))
    child_cpu = {"pid": str(PID + 1), "mode": "user"}
    assert registry.get_sample_value("dlprof_process_cpu_seconds_total", child_cpu) == 12.5

    current[0] = snapshot(processes=(process(),))

    text = generate_latest(registry).decode()
    assert f'pid="{PID + 1}"' not in text
    assert registry.get_sample_value("dlprof_process_cpu_seconds_total", child_cpu) is None
    assert registry.get_sample_value("dlprof_process_cpu_seconds_total",
                                     {"pid": str(PID), "mode": "user"}) == 12.5


# --- golden exposition -------------------------------------------------------------

GOLDEN_SNAPSHOT = Snapshot(
    timestamp_seconds=1_700_000_100.0, monotonic_seconds=50.0, target_pid=PID, target_up=True,
    processes=(ProcessSample(
        pid=PID, ppid=1, name="python", is_target=True, start_time_seconds=1_700_000_000.0,
        user_seconds=12.5, system_seconds=1.5, iowait_seconds=0.25, rss_bytes=100 << 20,
        vms_bytes=1 << 30, rss_peak_bytes=200 << 20, threads=2,
        thread_groups=(ThreadGroupSample("python", 2, 12.5, 1.5, 0.25),),
        voluntary_context_switches=100, involuntary_context_switches=7,
        read_bytes=4096, write_bytes=8192, read_chars=None, write_chars=None, open_fds=None),),
    host=None, gpu=GpuSample(available=False), collector_errors=(("process", 2),),
    sample_duration_seconds=0.0125, samples_total=7)

GOLDEN_EXPOSITION = f"""\
# HELP dlprof_agent_info The agent's version.
# TYPE dlprof_agent_info gauge
dlprof_agent_info{{version="{__version__}"}} 1.0
# HELP dlprof_agent_interval_seconds Time between sampling passes.
# TYPE dlprof_agent_interval_seconds gauge
dlprof_agent_interval_seconds 1.0
# HELP dlprof_collector_errors_total Failed reads per collector; each distinct failure is logged once.
# TYPE dlprof_collector_errors_total counter
dlprof_collector_errors_total{{collector="process"}} 2.0
# HELP dlprof_agent_samples_total Sampling passes so far.
# TYPE dlprof_agent_samples_total counter
dlprof_agent_samples_total 7.0
# HELP dlprof_agent_sample_duration_seconds How long the last sampling pass took.
# TYPE dlprof_agent_sample_duration_seconds gauge
dlprof_agent_sample_duration_seconds 0.0125
# HELP dlprof_agent_last_sample_timestamp_seconds When the last sampling pass started, in seconds since the Unix epoch.
# TYPE dlprof_agent_last_sample_timestamp_seconds gauge
dlprof_agent_last_sample_timestamp_seconds 1.7000001e+09
# HELP dlprof_target_up 1 while the attached process runs, 0 once it has exited.
# TYPE dlprof_target_up gauge
dlprof_target_up{{pid="4242"}} 1.0
# HELP dlprof_process_info Processes the agent reads: the target and its descendants.
# TYPE dlprof_process_info gauge
dlprof_process_info{{name="python",pid="4242",ppid="1",role="target"}} 1.0
# HELP dlprof_process_cpu_seconds_total CPU seconds by mode; iowait is time blocked on block I/O.
# TYPE dlprof_process_cpu_seconds_total counter
dlprof_process_cpu_seconds_total{{mode="user",pid="4242"}} 12.5
dlprof_process_cpu_seconds_total{{mode="system",pid="4242"}} 1.5
dlprof_process_cpu_seconds_total{{mode="iowait",pid="4242"}} 0.25
# HELP dlprof_process_resident_memory_bytes Resident memory.
# TYPE dlprof_process_resident_memory_bytes gauge
dlprof_process_resident_memory_bytes{{pid="4242"}} 1.048576e+08
# HELP dlprof_process_resident_memory_peak_bytes Highest resident memory since the agent attached.
# TYPE dlprof_process_resident_memory_peak_bytes gauge
dlprof_process_resident_memory_peak_bytes{{pid="4242"}} 2.097152e+08
# HELP dlprof_process_virtual_memory_bytes Virtual memory size.
# TYPE dlprof_process_virtual_memory_bytes gauge
dlprof_process_virtual_memory_bytes{{pid="4242"}} 1.073741824e+09
# HELP dlprof_process_threads Threads in the process.
# TYPE dlprof_process_threads gauge
dlprof_process_threads{{pid="4242"}} 2.0
# HELP dlprof_thread_group_cpu_seconds_total CPU seconds of the threads sharing a name, by mode.
# TYPE dlprof_thread_group_cpu_seconds_total counter
dlprof_thread_group_cpu_seconds_total{{mode="user",pid="4242",thread_name="python"}} 12.5
dlprof_thread_group_cpu_seconds_total{{mode="system",pid="4242",thread_name="python"}} 1.5
dlprof_thread_group_cpu_seconds_total{{mode="iowait",pid="4242",thread_name="python"}} 0.25
# HELP dlprof_thread_group_threads Live threads sharing a name.
# TYPE dlprof_thread_group_threads gauge
dlprof_thread_group_threads{{pid="4242",thread_name="python"}} 2.0
# HELP dlprof_process_context_switches_total Context switches: voluntary (waits) and involuntary (preempted).
# TYPE dlprof_process_context_switches_total counter
dlprof_process_context_switches_total{{kind="voluntary",pid="4242"}} 100.0
dlprof_process_context_switches_total{{kind="involuntary",pid="4242"}} 7.0
# HELP dlprof_process_io_bytes_total Bytes read from and written to storage.
# TYPE dlprof_process_io_bytes_total counter
dlprof_process_io_bytes_total{{direction="read",pid="4242"}} 4096.0
dlprof_process_io_bytes_total{{direction="write",pid="4242"}} 8192.0
# HELP dlprof_process_io_logical_bytes_total Bytes passed through read and write system calls, page-cache hits included.
# TYPE dlprof_process_io_logical_bytes_total counter
# HELP dlprof_process_open_fds Open file descriptors.
# TYPE dlprof_process_open_fds gauge
# HELP dlprof_process_main_thread_run_queue_wait_seconds_total Time the main thread was runnable but waited in a run queue for a CPU (the kernel's schedstat): its share of the main thread's runnable time is CPU it was denied.
# TYPE dlprof_process_main_thread_run_queue_wait_seconds_total counter
# HELP dlprof_process_main_thread_run_seconds_total Time the main thread ran on a CPU (the kernel's schedstat).
# TYPE dlprof_process_main_thread_run_seconds_total counter
# HELP dlprof_process_start_time_seconds Process start, in seconds since the Unix epoch.
# TYPE dlprof_process_start_time_seconds gauge
dlprof_process_start_time_seconds{{pid="4242"}} 1.7e+09
# HELP dlprof_gpu_available 1 when NVML is loaded and sees at least one GPU, else 0.
# TYPE dlprof_gpu_available gauge
dlprof_gpu_available 0.0
# HELP dlprof_probe_up 1 while the agent reads the in-process probe of the process, else 0.
# TYPE dlprof_probe_up gauge
dlprof_probe_up{{pid="4242"}} 0.0
# HELP dlprof_probe_stale 1 while the probe's figures are its last good sample, kept because this pass's read missed its deadline, else 0.
# TYPE dlprof_probe_stale gauge
dlprof_probe_stale{{pid="4242"}} 0.0
# HELP dlprof_probe_deadline_misses_total Probe reads that missed their deadline (no whole reply in time).
# TYPE dlprof_probe_deadline_misses_total counter
dlprof_probe_deadline_misses_total{{pid="4242"}} 0.0
"""  # noqa: E501 - exposition lines are as long as their HELP text


def test_golden_exposition() -> None:
    assert generate_latest(registry_for(GOLDEN_SNAPSHOT)).decode() == GOLDEN_EXPOSITION


# --- the HTTP endpoint -------------------------------------------------------------


class Health:
    def __init__(self) -> None:
        self.healthy = True

    def __call__(self) -> tuple[bool, dict[str, Any]]:
        return self.healthy, {"target_pid": PID, "last_sample_age_seconds": 0.5}


@pytest.fixture
def health() -> Health:
    return Health()


@pytest.fixture
def server(health: Health) -> Iterator[MetricsServer]:
    metrics = MetricsServer(registry_for(snapshot()), host="127.0.0.1", port=0, health=health)
    metrics.start()
    yield metrics
    metrics.stop()


def get(server: MetricsServer, path: str, accept: str | None = None
        ) -> tuple[int, str, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}")
    if accept is not None:
        request.add_header("Accept", accept)
    try:
        with urllib.request.urlopen(request, timeout=SCRAPE_TIMEOUT_SECONDS) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.headers["Content-Type"], error.read()


def test_metrics_endpoint_serves_the_exposition(server: MetricsServer) -> None:
    assert server.port != 0
    status, content_type, body = get(server, "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain")
    text = body.decode()
    assert f'dlprof_target_up{{pid="{PID}"}} 1.0' in text
    assert text == generate_latest(registry_for(snapshot())).decode()

    status, _, query_body = get(server, "/metrics?debug=1")
    assert status == 200
    assert query_body == body


def test_metrics_endpoint_speaks_openmetrics_when_asked(server: MetricsServer) -> None:
    status, content_type, body = get(server, "/metrics",
                                     accept="application/openmetrics-text; version=1.0.0")
    assert status == 200
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


def test_healthz_follows_health(server: MetricsServer, health: Health) -> None:
    status, content_type, body = get(server, "/healthz")
    assert (status, content_type) == (200, "application/json")
    assert json.loads(body) == {"status": "ok", "target_pid": PID,
                                "last_sample_age_seconds": 0.5}

    health.healthy = False
    status, _, body = get(server, "/healthz")
    assert status == 503
    assert json.loads(body)["status"] == "stale"


def test_index_and_unknown_paths(server: MetricsServer) -> None:
    status, content_type, body = get(server, "/")
    assert status == 200
    assert content_type.startswith("text/html")
    assert b'href="/metrics"' in body

    status, _, _ = get(server, "/nope")
    assert status == 404


def test_a_port_in_use_raises_oserror(health: Health) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as error:
            MetricsServer(CollectorRegistry(), host="127.0.0.1", port=port, health=health)
        assert error.value.errno == errno.EADDRINUSE


def test_a_second_server_on_the_same_port_raises_oserror(server: MetricsServer,
                                                         health: Health) -> None:
    with pytest.raises(OSError) as error:
        MetricsServer(CollectorRegistry(), host="127.0.0.1", port=server.port, health=health)
    assert error.value.errno == errno.EADDRINUSE


# --- the in-process probe ----------------------------------------------------------

PROBE = ProbeSample(
    pid=PID, step_source="optimizer", steps=(("steady", 4), ("warmup", 10)),
    samples=(("steady", 128), ("warmup", 320)), step_bucket_bounds=(0.01, 0.1, 1.0),
    step_bucket_counts=(1, 2, 0, 1), step_seconds_sum=2.5, last_step_seconds=0.05,
    phase_seconds=(("backward", 1.0), ("forward", 0.5), ("other", 1.0)),
    layers=(LayerSample("features.0", 0.5, 4, 1.0, 4), LayerSample("fc", 0.1, 4, 0.0, 0)),
    hook_errors=0, dropped_messages=(("malformed", 2),),
    settings=(("torch", (("framework", "pytorch"), ("intra_op_threads", "8"),
                         ("surprise", "ignored"))),))


IDENTITY = Identity(job_id="run-7", rank="1", local_rank="1", node_rank="0", world_size=2,
                    restart_count="0", node="gpu-node-3", role="rank")


def test_probe_families() -> None:
    registry = registry_for(dataclasses.replace(snapshot(), probe=PROBE, probe_up=True,
                                                identity=IDENTITY))
    value = registry.get_sample_value
    labels = {"pid": str(PID)}
    job = {**labels, "job_id": "run-7", "rank": "1"}  # the step families' labels
    assert value("dlprof_probe_up", labels) == 1
    assert value("dlprof_steps_total", {**job, "phase": "steady"}) == 4
    assert value("dlprof_samples_total", {**job, "phase": "warmup"}) == 320
    # Buckets are cumulative on the wire; the probe sends them per bucket.
    assert [value("dlprof_step_duration_seconds_bucket", {**job, "le": le})
            for le in ("0.01", "0.1", "1.0", "+Inf")] == [1, 3, 3, 4]
    assert value("dlprof_step_duration_seconds_count", job) == 4
    assert value("dlprof_step_duration_seconds_sum", job) == 2.5
    assert value("dlprof_layer_seconds_total",
                 {**labels, "layer": "features.0", "phase": "backward"}) == 1.0
    # A phase a layer never ran in has no series rather than a zero.
    assert value("dlprof_layer_seconds_total", {**labels, "layer": "fc",
                                                 "phase": "backward"}) is None
    assert value("dlprof_layer_calls_total", {**labels, "layer": "fc", "phase": "forward"}) == 4
    assert value("dlprof_step_phase_seconds_total", {**job, "phase": "other"}) == 1.0
    assert value("dlprof_target_world_size", job) == 2
    assert value("dlprof_target_info", {
        **job, "local_rank": "1", "node_rank": "0", "world_size": "2", "restart_count": "0",
        "node": "gpu-node-3", "role": "rank", "pod_uid": "", "container_id": "", "pod": "",
        "namespace": ""}) == 1
    assert value("dlprof_probe_dropped_messages_total", {**labels, "reason": "malformed"}) == 2
    info = [metric for metric in registry.collect() if metric.name == "dlprof_framework_info"]
    (sample,) = info[0].samples
    assert sample.labels["framework"] == "pytorch"
    assert sample.labels["intra_op_threads"] == "8"
    assert sample.labels["blas"] == ""  # unknown stays empty
    assert "surprise" not in sample.labels  # the label set is fixed


def test_no_probe_is_probe_up_0_and_nothing_else() -> None:
    registry = registry_for(snapshot())
    assert registry.get_sample_value("dlprof_probe_up", {"pid": str(PID)}) == 0
    assert registry.get_sample_value("dlprof_steps_total", {
        "pid": str(PID), "job_id": "", "rank": "", "phase": "steady"}) is None
