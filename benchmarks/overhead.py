"""Training overhead: how much slower a reference workload trains with the agent
attached, against no agent, and against the usual alternatives on the same job.

One training process per workload (benchmarks.training_job) runs blocks of
steps on command. The configurations take turns block by block, at least five
rounds, and each round starts with a different one, so the machine's drift
hits them all alike. Around a block the harness starts and stops the real
thing: `dlprof-agent attach PID` (at 1 s and 0.1 s, --no-probe), with the
probe's step timing, with --layers (its default budget, and every step timed);
torch.profiler (CPU activities) or
tf.profiler inside the job; `py-spy record --rate 100 --nonblocking`. A
block's overhead is its median step time over the median of the same round's
no-agent block, minus one (to first order, the throughput lost).
"""

from __future__ import annotations

import json
import math
import select
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    CORES,
    Column,
    HostBusy,
    Option,
    Processes,
    Progress,
    Result,
    Table,
    TargetCheck,
    agent_command,
    cpu_seconds,
    free_port,
    get,
    load_average,
    metric_value,
    percentile,
    positive_float,
    positive_int,
    spread,
    str_list,
    wait_until,
)

NAME = "overhead"
TITLE = "Training overhead"
SUMMARY = ("throughput of a CNN and the LSTM (PyTorch, TensorFlow) with no agent, the "
           "agent at 1 s and 0.1 s, + probe step timing, + --layers, torch.profiler/"
           "tf.profiler and py-spy at 100 Hz, interleaved")
TARGETS = ("agent at 1 s + step timing <= 0.5%; with --layers <= 1%; >= 10x less "
           "overhead than torch.profiler for the same per-layer breakdown")
STEPS_TARGET = 0.005
LAYERS_TARGET = 0.01
PROFILER_FACTOR = 10.0
SETTLE_STEPS = 5  # a block's first steps: the probe finds the model, a profiler starts

OPTIONS = (
    Option("--workloads", ["pytorch:small-cnn", "pytorch:lstm", "tensorflow:small-cnn",
                           "tensorflow:lstm"], ["pytorch:small-cnn"],
           "FRAMEWORK:MODEL pairs; models small-cnn and lstm", str_list, "LIST"),
    Option("--configs", None, None,
           "configurations, 'off' always included; all: off,agent-1s,agent-0.1s,steps-1s,"
           "layers-1s,layers-all-1s,profiler,py-spy", str_list, "LIST"),
    Option("--rounds", 5, 1, "rounds: each configuration runs once per round",
           positive_int, "N"),
    Option("--block-seconds", 4.0, 0.3, "training time per block", positive_float, "S"),
    Option("--threads", CORES, 1, "the job's intra-op threads", positive_int, "N",
           "the number of cores"),
    Option("--cnn-batch", 32, 8, "small CNN: samples per step", positive_int, "N"),
    Option("--lstm-batch", 16, 4, "LSTM: samples per step", positive_int, "N"),
    Option("--lstm-vocabulary", 2000, 500, "LSTM: vocabulary", positive_int, "N"),
    Option("--lstm-hidden", 128, 32, "LSTM: hidden units (2 layers)", positive_int, "N"),
    Option("--lstm-sequence", 20, 8, "LSTM: tokens per sample", positive_int, "N"),
)


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    agent_args: tuple[str, ...] | None = None  # None: no agent around the block
    probe: bool = False  # the agent must be reading the probe before the block starts
    profiler: bool = False  # the framework's profiler runs inside the job
    py_spy: bool = False


CONFIGS = (
    Config("off", "no agent"),
    Config("agent-1s", "agent, 1 s, --no-probe", ("--interval", "1", "--no-probe")),
    Config("agent-0.1s", "agent, 0.1 s, --no-probe", ("--interval", "0.1", "--no-probe")),
    Config("steps-1s", "agent, 1 s + probe step timing", ("--interval", "1", "--no-inject"),
           probe=True),
    Config("layers-1s", "agent, 1 s + probe --layers",
           ("--interval", "1", "--no-inject", "--layers"), probe=True),
    Config("layers-all-1s", "agent, 1 s + --layers --layers-every 1",
           ("--interval", "1", "--no-inject", "--layers", "--layers-every", "1"), probe=True),
    Config("profiler", "framework profiler, CPU", profiler=True),
    Config("py-spy", "py-spy record, 100 Hz, --nonblocking", py_spy=True),
)


class TrainingJob:
    """A benchmarks.training_job process: blocks of steps on command."""

    def __init__(self, processes: Processes, framework: str, model: str, *, batch: int,
                 threads: int, warmup_seconds: float, lstm: tuple[int, int, int] | None = None
                 ) -> None:
        """``lstm``: vocabulary, hidden units and sequence length."""
        self.batch = batch
        sizes = [] if lstm is None else [
            "--vocabulary", str(lstm[0]), "--hidden", str(lstm[1]), "--sequence", str(lstm[2])]
        self.process = processes.start(
            [sys.executable, "-m", "benchmarks.training_job", "--framework", framework,
             "--model", model, "--batch", str(batch), "--threads", str(threads), *sizes,
             "--warmup-seconds", str(warmup_seconds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pid = self.process.pid
        line = self._read_line(timeout=300)
        if not line.startswith("ready"):
            raise RuntimeError(f"the {framework} {model} job did not start: {line!r}")
        self.step_seconds = float(line.split()[1])

    def _read_line(self, timeout: float) -> str:
        stdout = self.process.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], timeout)
        if not ready:
            raise RuntimeError(f"the training job said nothing for {timeout:g} s")
        return stdout.readline().strip()

    def run_block(self, steps: int, *, profiler: bool = False) -> list[float]:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(f"{steps} {'profiler' if profiler else 'plain'}\n")
        stdin.flush()
        line = self._read_line(timeout=600)
        if not line:
            raise RuntimeError(f"the training job exited ({self.process.poll()})")
        durations: list[float] = json.loads(line)
        return durations


def _py_spy() -> str | None:
    found = shutil.which("py-spy")
    local = Path(sys.executable).parent / "py-spy"
    return found or (str(local) if local.exists() else None)


def py_spy_problem(pid: int) -> str | None:
    """Why py-spy cannot sample the job, or None when it can."""
    binary = _py_spy()
    if binary is None:
        return "py-spy is not installed (pip install py-spy)"
    check = subprocess.run([binary, "dump", "--pid", str(pid), "--nonblocking"],
                           capture_output=True, text=True, timeout=60, check=False)
    if check.returncode != 0:
        why = (check.stderr or check.stdout).strip().splitlines()
        return "py-spy cannot attach: " + (why[-1] if why else f"exit {check.returncode}")
    return None


class Around:
    """What runs outside the job around one block: an agent or py-spy."""

    def __init__(self, processes: Processes, config: Config, pid: int) -> None:
        self.processes = processes
        self.config = config
        self.pid = pid
        self.process: subprocess.Popen[str] | None = None
        self.port = 0

    def start(self) -> None:
        if self.config.agent_args is not None:
            self.port = free_port()
            self.process = self.processes.start(
                agent_command("attach", str(self.pid), "--port", str(self.port), "--quiet",
                              "--grace", "0", *self.config.agent_args))
            wait_until(lambda: get(self.port, "/healthz").status == 200,
                       "the agent's /healthz", alive=self.process)
            if self.config.probe:
                wait_until(lambda: self._probe_value("dlprof_probe_up") == 1,
                           "the agent to read the job's probe", alive=self.process)
        elif self.config.py_spy:
            binary = _py_spy()
            assert binary is not None
            self.process = self.processes.start(
                [binary, "record", "--rate", "100", "--pid", str(self.pid), "--nonblocking",
                 "-o", "/dev/null"], stdout=subprocess.DEVNULL,
                stop_signal=signal.SIGINT)  # py-spy ends its recording on Ctrl-C
            time.sleep(0.5)  # it starts sampling within milliseconds; make sure it lives
            if self.process.poll() is not None:
                raise RuntimeError(f"py-spy exited with {self.process.returncode}")

    def _probe_value(self, name: str) -> float | None:
        return metric_value(get(self.port, "/metrics").body, name, pid=str(self.pid))

    def probe_seen(self, block_ended: float) -> tuple[int, int]:
        """Steady steps and layers the agent got from the probe, from a sample
        taken after the block ended."""
        def fresh() -> bytes | None:
            body = get(self.port, "/metrics").body
            last = metric_value(body, "dlprof_agent_last_sample_timestamp_seconds")
            return body if last is not None and last > block_ended else None
        body: bytes = wait_until(fresh, "a sample after the block", timeout=10)
        text = body.decode()
        steps = metric_value(body, "dlprof_steps_total", pid=str(self.pid), phase="steady")
        layers = {line.split('layer="', 1)[1].split('"', 1)[0]
                  for line in text.splitlines() if line.startswith("dlprof_layer_calls_total{")}
        return int(steps or 0), len(layers)

    def stop(self) -> None:
        if self.process is not None:
            self.processes.stop(self.process, timeout=20)
            self.process = None


def run(settings: dict[str, Any]) -> Result:
    chosen = settings["configs"] or [c.key for c in CONFIGS]
    unknown = set(chosen) - {c.key for c in CONFIGS}
    if unknown:
        raise SystemExit(f"overhead: unknown configuration(s) {', '.join(sorted(unknown))}")
    configs = [c for c in CONFIGS if c.key == "off" or c.key in chosen]
    settings = {**settings, "configs": [c.key for c in configs]}
    workloads = []
    for spec in settings["workloads"]:
        framework, _, model = spec.partition(":")
        if framework not in ("pytorch", "tensorflow") or model not in ("small-cnn", "lstm"):
            raise SystemExit(f"overhead: {spec!r} is not FRAMEWORK:MODEL with FRAMEWORK "
                             "pytorch or tensorflow and MODEL small-cnn or lstm")
        workloads.append((framework, model))

    result = Result(NAME, TITLE, __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
                    settings["smoke"], settings)
    rounds = int(settings["rounds"])
    progress = Progress(NAME, len(workloads) * rounds * len(configs))
    busy = HostBusy()
    load_start = load_average()
    baseline_spreads: list[float] = []
    block_noise: list[float] = []
    unavailable: dict[str, str] = {}
    for framework, model in workloads:
        workload = f"{framework} {model}"
        with Processes() as processes:
            progress.note(f"starting the {workload} job")
            job = TrainingJob(
                processes, framework, model,
                batch=int(settings["cnn_batch" if model == "small-cnn" else "lstm_batch"]),
                threads=int(settings["threads"]),
                warmup_seconds=0.5 if settings["smoke"] else 3.0,
                lstm=(int(settings["lstm_vocabulary"]), int(settings["lstm_hidden"]),
                      int(settings["lstm_sequence"])))
            steps = max(SETTLE_STEPS + 10,
                        math.ceil(float(settings["block_seconds"]) / job.step_seconds))
            active = list(configs)
            if any(c.py_spy for c in active):
                problem = py_spy_problem(job.pid)
                if problem is not None:
                    unavailable["py-spy"] = problem
                    active = [c for c in active if not c.py_spy]
            medians: dict[str, list[float]] = {c.key: [] for c in active}
            # The job's own CPU per step: what runs inside it (probe, profiler) shows
            # there without the wall-clock noise of a shared machine.
            job_cpu: dict[str, list[float]] = {c.key: [] for c in active}
            seen: dict[str, list[tuple[int, int]]] = {c.key: [] for c in active}
            for round_index in range(rounds):
                shift = round_index % len(active)  # each round opens with another config
                for config in active[shift:] + active[:shift]:
                    around = Around(processes, config, job.pid)
                    try:
                        around.start()
                        busy.start()
                        cpu_before = cpu_seconds(job.pid)
                        durations = job.run_block(steps + SETTLE_STEPS,
                                                  profiler=config.profiler)
                        job_cpu[config.key].append((cpu_seconds(job.pid) - cpu_before)
                                                   / (steps + SETTLE_STEPS))
                        busy.stop()
                        if config.probe:
                            seen[config.key].append(around.probe_seen(time.time()))
                    finally:
                        around.stop()
                    steady = durations[SETTLE_STEPS:]
                    medians[config.key].append(statistics.median(steady))
                    if config.key == "off":
                        block_noise.append((percentile(steady, 75) - percentile(steady, 25))
                                           / statistics.median(steady))
                    progress.advance(f"{workload}, round {round_index + 1}: {config.key} "
                                     f"{medians[config.key][-1] * 1e3:.2f} ms/step")
        base = medians["off"]
        baseline_spreads.append(spread(base))
        _add_workload(result, workload=workload, framework=framework, batch=job.batch,
                      steps=steps, configs=active, medians=medians, seen=seen,
                      job_cpu=job_cpu)
    load_end = load_average()

    worst = max(baseline_spreads)
    result.noise = {"baseline_spread_per_workload": baseline_spreads,
                    "baseline_block_iqr_over_median": statistics.median(block_noise),
                    "host_busy_share_during_blocks": statistics.fmean(busy.shares),
                    "load_average_start": load_start[0], "load_average_end": load_end[0]}
    result.noise_summary = (
        f"the no-agent blocks of a workload spread by up to {worst:.1%} across rounds "
        f"(max-min over median; per workload: "
        + ", ".join(f"{s:.1%}" for s in baseline_spreads)
        + f"); within a block the steps' interquartile range is "
        f"{statistics.median(block_noise):.1%} of the median. The machine's cores were "
        f"{statistics.fmean(busy.shares):.0%} busy during blocks (the job included); load "
        f"average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end. "
        f"Overheads smaller than the spread are within noise.")
    result.figures["baseline_spread_max"] = worst
    for key, why in unavailable.items():
        result.unavailable.append(f"{key}: {why}")
    threads = int(settings["threads"])
    result.notes += [
        f"The job runs {threads} intra-op thread(s) on {CORES} cores"
        + (", so the agent's own CPU competes with it, as it would on a fully used node."
           if threads >= CORES else
           "; the agent can run on an idle core, so this measures mostly the in-process "
           "part (the probe) and shared caches."),
        "TensorFlow's reference models train compiled (train_on_batch on a graph), so "
        "--layers can time no single layer there (dlprof_framework_info says so); its row "
        "measures the hooks alone. The profiler row for TensorFlow is tf.profiler "
        "(start/stop around the block).",
        "The agent and py-spy are started before and stopped after each block; only the "
        "steps inside the block are timed, after "
        f"{SETTLE_STEPS} settling steps.",
        "Job CPU per step is the job process's user and system CPU over the block (from "
        "/proc, settling steps included) divided by its steps. It counts what runs inside "
        "the job (the probe's hooks, a profiler) and not the agent's own process, and "
        "other tenants of the machine move it much less than wall time.",
    ]
    return result


def _add_workload(result: Result, *, workload: str, framework: str, batch: int, steps: int,
                  configs: list[Config], medians: dict[str, list[float]],
                  seen: dict[str, list[tuple[int, int]]],
                  job_cpu: dict[str, list[float]]) -> None:
    base = medians["off"]
    slug = workload.replace(" ", "_").replace("-", "_")
    table = Table(f"{slug}", f"{workload}: batch {batch}, {steps}-step blocks, "
                  f"{len(base)} round(s)", [
                      Column("config", "configuration"),
                      Column("step_seconds", "median step", "ms"),
                      Column("samples_per_second", "samples/s", "int"),
                      Column("overhead_median", "overhead: median", "spct"),
                      Column("overhead_min", "min", "spct"),
                      Column("overhead_max", "max", "spct"),
                      Column("job_cpu_per_step", "job CPU per step", "ms"),
                      Column("job_cpu_overhead", "job CPU: median", "spct"),
                      Column("probe_steps", "steps the probe saw", "int"),
                      Column("probe_layers", "layers it timed", "int"),
                      Column("target", "target"),
                      Column("verdict", "verdict", "met")])
    overheads: dict[str, float] = {}
    for config in configs:
        step = statistics.median(medians[config.key])
        row: dict[str, Any] = {"config": config.label, "step_seconds": step,
                               "samples_per_second": batch / step}
        if config.key != "off":
            ratios = [on / off - 1 for on, off in zip(medians[config.key], base, strict=True)]
            overheads[config.key] = statistics.median(ratios)
            row.update(overhead_median=overheads[config.key], overhead_min=min(ratios),
                       overhead_max=max(ratios))
        cpu = job_cpu.get(config.key, [])
        if cpu:
            row["job_cpu_per_step"] = statistics.median(cpu)
        if config.key != "off" and cpu and len(cpu) == len(job_cpu["off"]):
            row["job_cpu_overhead"] = statistics.median(
                [on / off - 1 for on, off in zip(cpu, job_cpu["off"], strict=True) if off > 0])
            result.figures[f"{slug}.{config.key}.job_cpu_overhead"] = row["job_cpu_overhead"]
        if seen.get(config.key):
            row["probe_steps"] = min(s for s, _ in seen[config.key])
            row["probe_layers"] = min(n for _, n in seen[config.key])
        table.rows.append(row)
        result.figures[f"{slug}.{config.key}.step_seconds"] = step
        if config.key != "off":
            result.figures[f"{slug}.{config.key}.overhead_median"] = overheads[config.key]

    def check(key: str, name: str, limit: float) -> None:
        if key not in overheads:
            return
        met = overheads[key] <= limit
        for row in table.rows:
            if row["config"] == next(c.label for c in configs if c.key == key):
                row.update(target=f"≤ {limit:.1%}", verdict=met)
        result.targets.append(TargetCheck(f"{workload}: {name}", f"overhead ≤ {limit:.1%}",
                                          f"{overheads[key]:+.2%} (median of rounds)", met))

    check("steps-1s", "agent 1 s + step timing", STEPS_TARGET)
    check("layers-1s", "agent 1 s + --layers", LAYERS_TARGET)
    if "profiler" in overheads and "layers-1s" in overheads:
        profiler, layers = overheads["profiler"], overheads["layers-1s"]
        name = f"{workload}: vs the framework profiler"
        requirement = f"≥ {PROFILER_FACTOR:.0f}x less overhead than it, same breakdown"
        if framework == "tensorflow":
            result.targets.append(TargetCheck(
                name, requirement, "n/a: compiled Keras has no per-layer breakdown from "
                "the probe to compare", None))
        elif layers <= 0:
            result.targets.append(TargetCheck(
                name, requirement, f"--layers {layers:+.2%} (within noise), profiler "
                f"{profiler:+.2%}", profiler > 0))
        else:
            factor = profiler / layers
            result.targets.append(TargetCheck(
                name, requirement, f"{factor:.1f}x (profiler {profiler:+.2%}, --layers "
                f"{layers:+.2%})", factor >= PROFILER_FACTOR))
    result.tables.append(table)
