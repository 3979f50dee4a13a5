"""Snapshots of a busy node, built to a given number of series, and a /metrics
server that serves one through the agent's real exporter.

A node daemon's pass is built as the agent builds it (NodeSnapshot of per-job
Snapshots: processes with thread groups, and a probe sample with layers) and
rendered by exporters.prometheus.NodeCollector behind exporters.http.MetricsServer.
The series come where a real node has them: jobs, their ranks and loader
workers, thread names and, above all, layers (the probe keeps at most 512 per
job, plus "other").

    python -m benchmarks.exposition --series 1000     serve it; prints "port P series S"
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest

from dlprof_agent.collectors.gpu_samples import GpuSample
from dlprof_agent.collectors.host import HostSample
from dlprof_agent.collectors.process import ProcessSample
from dlprof_agent.collectors.threads import ThreadGroupSample
from dlprof_agent.exporters.http import MetricsServer
from dlprof_agent.exporters.prometheus import NodeCollector
from dlprof_agent.model.snapshot import AgentSelfSample, NodeSnapshot, Snapshot
from dlprof_agent.probe.messages import OTHER
from dlprof_agent.probe.recorder import DEFAULT_MAX_LAYERS, STEP_BUCKETS
from dlprof_agent.probe_link.samples import LayerSample, ProbeSample

MAX_LAYER_NAMES = DEFAULT_MAX_LAYERS + 1  # the named ones and "other"
THREAD_NAMES = ("pt_main_thread", "pt_autograd_0", "python", "omp_worker", "pt_dataloader",
                "dlprof-probe", "cuda-EvtHandlr", "jemalloc_bg_thd")


@dataclass(frozen=True)
class Shape:
    """A node: ``jobs`` training jobs of ``processes`` processes each (a launcher,
    ranks, loader workers), ``thread_groups`` thread names per process, and
    ``layers`` timed layer names per job."""

    jobs: int
    processes: int
    thread_groups: int
    layers: int

    def describe(self) -> str:
        return (f"{self.jobs} job(s) x {self.processes} process(es) x "
                f"{self.thread_groups} thread names, {self.layers} layers per job")


# Where each size of node sits; layers are then solved for the series count.
BASE_SHAPES = ((300, Shape(1, 1, 4, 0)), (3000, Shape(1, 4, 8, 0)), (10**9, Shape(4, 8, 8, 0)))


def _process(pid: int, *, target: bool, ppid: int, groups: int) -> ProcessSample:
    names = [*THREAD_NAMES[:groups], *(f"worker-{i}" for i in range(groups - len(THREAD_NAMES)))]
    return ProcessSample(
        pid=pid, ppid=ppid, name="python", is_target=target, start_time_seconds=1.7e9,
        user_seconds=1234.5, system_seconds=56.7, iowait_seconds=0.5, rss_bytes=6 << 30,
        vms_bytes=20 << 30, rss_peak_bytes=7 << 30, threads=groups * 2,
        thread_groups=tuple(ThreadGroupSample(name, 2, 100.0 + i, 10.0, 0.25)
                            for i, name in enumerate(names[:groups])),
        voluntary_context_switches=100_000, involuntary_context_switches=5_000,
        read_bytes=1 << 30, write_bytes=1 << 20, read_chars=2 << 30, write_chars=2 << 20,
        open_fds=64)


def _probe(pid: int, layers: int) -> ProbeSample:
    names = [f"model.blocks.{i // 4}.{('conv1', 'bn1', 'conv2', 'bn2')[i % 4]}"
             for i in range(min(layers, DEFAULT_MAX_LAYERS))]
    if layers > DEFAULT_MAX_LAYERS:
        names.append(OTHER)
    return ProbeSample(
        pid=pid, step_source="optimizer", steps=(("steady", 10_000), ("warmup", 10)),
        samples=(("steady", 640_000), ("warmup", 640)), step_bucket_bounds=STEP_BUCKETS,
        step_bucket_counts=(0, 0, 10, 500, 9000, 400, 80, 10, 0, 0, 0, 0, 0, 0, 0, 0),
        step_seconds_sum=300.0, last_step_seconds=0.021,
        phase_seconds=(("backward", 180.0), ("forward", 90.0), ("optimizer", 20.0),
                       ("other", 10.0)),
        layers=tuple(LayerSample(name, 0.5, 10_000, 1.0, 10_000) for name in names),
        hook_errors=0, dropped_messages=(),
        settings=(("torch", (("framework", "pytorch"), ("framework_version", "2.13.0"),
                             ("intra_op_threads", "16"), ("layer_timing", "on"))),))


def node_snapshot(shape: Shape) -> NodeSnapshot:
    now, monotonic = time.time(), time.monotonic()
    targets = []
    for job in range(shape.jobs):
        launcher = 10_000 + 100 * job
        processes = [_process(launcher + rank, target=rank == 0, ppid=1 if rank == 0
                              else launcher, groups=shape.thread_groups)
                     for rank in range(shape.processes)]
        targets.append(Snapshot(
            timestamp_seconds=now, monotonic_seconds=monotonic, target_pid=launcher,
            target_up=True, processes=tuple(processes), probe=_probe(launcher, shape.layers),
            probe_up=True))
    host = HostSample(
        cpu_seconds=(("user", 1e5), ("nice", 0.0), ("system", 1e4), ("idle", 1e6),
                     ("iowait", 10.0), ("irq", 0.0), ("softirq", 5.0), ("steal", 0.0)),
        logical_cpus=64, physical_cpus=32, memory_total_bytes=512 << 30,
        memory_available_bytes=256 << 30, swap_total_bytes=0, swap_used_bytes=0,
        swap_in_bytes=0, swap_out_bytes=0, load_average=(30.0, 29.0, 28.0))
    return NodeSnapshot(timestamp_seconds=now, monotonic_seconds=monotonic, host=host,
                        gpu=GpuSample(available=False), targets=tuple(targets),
                        collector_errors=(("process", 0), ("host", 0)),
                        sample_duration_seconds=0.004, samples_total=1000,
                        agent=AgentSelfSample(12.0, 40 << 20, 42 << 20))


def registry_for(snapshot: NodeSnapshot) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: snapshot, interval_seconds=1.0))
    return registry


def series_count(registry: CollectorRegistry) -> int:
    return sum(1 for line in generate_latest(registry).splitlines()
               if line and not line.startswith(b"#"))


def shape_for(series: int) -> tuple[Shape, int]:
    """A realistic node with about ``series`` series, and its exact count."""
    base = next(shape for limit, shape in BASE_SHAPES if series <= limit)
    without_layers = series_count(registry_for(node_snapshot(base)))
    one_layer = series_count(registry_for(node_snapshot(dataclasses.replace(base, layers=1))))
    per_layer = one_layer - without_layers  # seconds and calls, forward and backward, per job
    layers = round((series - without_layers) / per_layer) if per_layer else 0
    layers = max(0, min(layers, MAX_LAYER_NAMES))
    shape = dataclasses.replace(base, layers=layers)
    return shape, series_count(registry_for(node_snapshot(shape)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.exposition",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--series", type=int, default=1000, help="about this many series")
    parser.add_argument("--as-agent", type=float, default=0.0, metavar="INTERVAL",
                        help="serve as the agent does: a new sample every INTERVAL seconds, "
                             "each rendered at most once; 0 renders every scrape (default)")
    args = parser.parse_args(argv)
    shape, count = shape_for(args.series)
    version: Callable[[], object] | None = None
    if args.as_agent:
        interval = args.as_agent
        # The renderer keeps a render while version() returns the same object.
        current: list[tuple[int, object]] = [(-1, object())]

        def sample() -> object:
            tick = int(time.monotonic() / interval)
            if current[0][0] != tick:
                current[0] = (tick, object())
            return current[0][1]
        version = sample
    server = MetricsServer(registry_for(node_snapshot(shape)), host="127.0.0.1", port=0,
                           health=lambda: (True, {}), version=version)
    server.start()
    print(f"port {server.port} series {count}", flush=True)
    sys.stdin.read()  # serve until the harness closes our stdin
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
