"""Training overhead: how much the probe slows a reference workload, measured
inside one job in paired blocks, against a planted slowdown and the
framework's own profiler.

One training process per workload and thread count (benchmarks.training_job)
runs blocks of tens of steps on command. For each configuration, pairs of
blocks run back to back, one with the measurement on and one off, the order
swapped every pair so that drift cancels (benchmarks.paired). The probe is
switched through its own protocol, as an agent does, and polled once a
second of on time; torch.profiler or tf.profiler is started inside the job
around its block. py-spy, which cannot be switched inside the job, is started
and stopped around its on block, paired the same way. A configuration's
overhead is the median over pairs of (mean step on / mean step off - 1), for
wall time and for the job's own CPU per step, with a 95% bootstrap interval;
a target is met when the interval's upper end is under it. Two checks of the
method itself run on the first workload, with more pairs: nothing against
nothing (the interval must hold 0) and a planted busy-wait of 0.5% of a step
(the interval must exclude 0; the job times the busy-wait itself, the truth the
method is held to).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    CORES,
    REPO,
    HostBusy,
    Option,
    Processes,
    Progress,
    Result,
    int_list,
    load_average,
    positive_float,
    positive_int,
    str_list,
)
from benchmarks.overhead_report import Config, Measured, add_comparison, add_workload
from benchmarks.paired import Pairs, ProbeDriver, TrainingJob, run_pairs

NAME = "overhead"
TITLE = "Training overhead"
SUMMARY = ("the probe's step timing and --layers, torch.profiler/tf.profiler and py-spy on "
           "a CNN and an LSTM (PyTorch, TensorFlow), in paired blocks inside one job, "
           "with intervals; a planted 0.5% slowdown checks the method")
TARGETS = ("step timing (with the split) <= 0.5%; --layers <= 1% and <= a tenth of "
           "torch.profiler's; each at the upper end of its 95% interval")
MEASURES = ("dlprof_agent/probe", "benchmarks/overhead.py", "benchmarks/paired.py",
            "benchmarks/training_job.py")
PLANTED = 0.005
SETTLE_STEPS = 5  # a block's first steps: the probe finds the model, a profiler starts


CONFIGS = (
    Config("same", "nothing (off against off)", first_only=True, method=True),
    Config("planted", f"planted busy-wait, {PLANTED:.1%} of a step",
           mode=f"planted={PLANTED}", first_only=True, method=True),
    Config("steps", "probe: step timing with the split", probe={"kernels": False},
           keep=True),
    # What a session's start and stop add when every block pays them: the only
    # way to run a probe older than pausing, hence the comparison's row.
    Config("steps-sessions", "probe: step timing, a session started and stopped every block",
           probe={"kernels": False}, first_only=True, compared=True),
    Config("kernels", "probe: step timing, split and CUDA kernels (the default)", probe={},
           keep=True, gpu_only=True),
    Config("layers", "probe: --layers (1% budget; on a GPU, with kernels)",
           probe={"layers": True}, keep=True,
           by_mean=True),
    Config("layers-all", "probe: --layers, every step timed",
           probe={"layers": True, "layers_every": 1}, first_only=True, compared=True),
    Config("profiler", "framework profiler, CPU", mode="profiler"),
    Config("py-spy", "py-spy record, 100 Hz, --nonblocking", py_spy=True),
)
CROSS_PROCESS = ("py-spy",)

OPTIONS = (
    Option("--workloads", ["pytorch:small-cnn", "pytorch:lstm", "tensorflow:small-cnn",
                           "tensorflow:lstm"], ["pytorch:small-cnn"],
           "FRAMEWORK:MODEL pairs; models small-cnn and lstm, and resnet-50 for pytorch "
           "(with --device cuda: gpu-check's)", str_list, "LIST"),
    Option("--device", "cpu", "cpu", "PyTorch jobs' device: cpu or cuda", str, "DEVICE"),
    Option("--configs", None, None,
           "configurations; all: " + ",".join(c.key for c in CONFIGS), str_list, "LIST"),
    Option("--threads", [1, CORES], [1], "the job's intra-op threads, one job for each",
           int_list, "LIST", "1 and the number of cores"),
    Option("--pairs", 150, 4, "pairs per configuration", positive_int, "N"),
    Option("--method-pairs", 400, 4, "pairs for the method's own checks (nothing against "
           "nothing, the planted slowdown)", positive_int, "N"),
    Option("--block-seconds", 0.1, 0.05, "training time per block (at least 10 steps)",
           positive_float, "S"),
    Option("--cross-pairs", 12, 2, "pairs for a tool started around its block (py-spy)",
           positive_int, "N"),
    Option("--cross-block-seconds", 2.0, 0.5, "training time per block for those",
           positive_float, "S"),
    Option("--compare", None, None, "also measure this git revision's probe (configs "
           "steps and layers-all, the first workload and thread count)", str, "REV"),
    Option("--cnn-batch", 32, 8, "small CNN and ResNet-50: samples per step", positive_int,
           "N"),
    Option("--lstm-batch", 16, 4, "LSTM: samples per step", positive_int, "N"),
    Option("--lstm-vocabulary", 2000, 500, "LSTM: vocabulary", positive_int, "N"),
    Option("--lstm-hidden", 128, 32, "LSTM: hidden units (2 layers)", positive_int, "N"),
    Option("--lstm-sequence", 20, 8, "LSTM: tokens per sample", positive_int, "N"),
)


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


def _switches(config: Config, job: TrainingJob, processes: Processes,
              driver: ProbeDriver) -> tuple[Any, Any]:
    if config.probe is not None:
        options = config.probe
        return (lambda: driver.on(options, keep=config.keep)), driver.off
    if config.py_spy:
        held: list[subprocess.Popen[str]] = []
        binary = _py_spy()
        assert binary is not None

        def start() -> None:
            held.append(processes.start(
                [binary, "record", "--rate", "100", "--pid", str(job.pid), "--nonblocking",
                 "-o", os.devnull], stdout=subprocess.DEVNULL, stop_signal=signal.SIGINT))
            time.sleep(0.5)  # it samples within milliseconds; make sure it lives
            if held[-1].poll() is not None:
                raise RuntimeError(f"py-spy exited with {held[-1].returncode}")

        return start, (lambda: processes.stop(held.pop(), timeout=20) if held else None)
    return (lambda: None), (lambda: None)


def measure(settings: dict[str, Any], job_spec: tuple[str, str, int], configs: list[Config],
            progress: Progress, *, code: Path | None = None,
            label: str = "") -> tuple[Measured, dict[str, str]]:
    """``job_spec``: framework, model and intra-op threads."""
    framework, model, threads = job_spec
    unavailable: dict[str, str] = {}
    with Processes() as processes:
        job = TrainingJob(
            processes, framework, model,
            batch=int(settings["lstm_batch" if model == "lstm" else "cnn_batch"]),
            threads=threads, warmup_seconds=0.5 if settings["smoke"] else 3.0,
            lstm=(int(settings["lstm_vocabulary"]), int(settings["lstm_hidden"]),
                  int(settings["lstm_sequence"])), code=code,
            device=settings["device"] if framework == "pytorch" else "cpu")
        steps = max(10, round(float(settings["block_seconds"]) / job.step_seconds))
        measured = Measured(label, framework, job.batch, steps,
                            settings["device"] if framework == "pytorch" else "cpu")
        driver = ProbeDriver(job.pid)
        try:
            for config in configs:
                if config.py_spy and (problem := py_spy_problem(job.pid)) is not None:
                    unavailable[config.key] = problem
                    progress.advance(f"{label}: {config.key} not measured")
                    continue
                cross = config.key in CROSS_PROCESS
                pairs = int(settings["cross_pairs" if cross else
                                     "method_pairs" if config.method else "pairs"])
                block = steps if not cross else max(steps, round(
                    float(settings["cross_block_seconds"]) / job.step_seconds))
                switch_on, switch_off = _switches(config, job, processes, driver)
                if config.keep:  # the duty cycle learns its rate before the pairs
                    switch_on()
                    job.block(10 * block)
                    switch_off()
                driver.own_cpu, driver.steps = 0.0, 0
                result = run_pairs(job, pairs, block, settle=SETTLE_STEPS,
                                   switch_on=switch_on, switch_off=switch_off,
                                   mode=config.mode, by_mean=config.by_mean)
                driver.close()
                measured.pairs[config.key] = result
                if config.probe is not None and driver.steps:
                    measured.own_cpu_per_step[config.key] = driver.own_cpu / driver.steps
                summary = result.summary()
                progress.advance(f"{label}: {config.key} {summary['wall']:+.2%} "
                                 f"[{summary['wall_low']:+.2%}, {summary['wall_high']:+.2%}]")
        finally:
            driver.finish()
    return measured, unavailable


def _old_code(revision: str, into: Path) -> Path:
    """``revision``'s dlprof_agent package, unpacked under ``into``."""
    archive = subprocess.run(["git", "archive", "--format=tar", revision, "dlprof_agent"],
                             cwd=REPO, capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"overhead: --compare {revision}: "
                         f"{archive.stderr.decode(errors='replace').strip()[:200]}")
    tar_path = into / "code.tar"
    tar_path.write_bytes(archive.stdout)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    return into


def _resolution(label: str, same: Pairs, target_pairs: int) -> str:
    """What nothing against nothing says the method resolves, with the method's
    pairs and with the first ``target_pairs`` of them (the targets' count)."""
    s = same.summary()
    text = (f"nothing against nothing ({label}, {s['pairs']:.0f} pairs) gave "
            f"{s['wall']:+.2%} with a 95% interval of [{s['wall_low']:+.2%}, "
            f"{s['wall_high']:+.2%}]: a difference smaller than about half that width, "
            f"±{(s['wall_high'] - s['wall_low']) / 2:.2%}, is not told from none")
    if target_pairs < s["pairs"]:
        few = Pairs(same.on[:target_pairs], same.off[:target_pairs]).summary()
        text += (f"; the first {target_pairs} of those pairs, as many as each target has, "
                 f"resolve ±{(few['wall_high'] - few['wall_low']) / 2:.2%}")
    return text + "."


def run(settings: dict[str, Any]) -> Result:
    chosen = settings["configs"] or [c.key for c in CONFIGS]
    unknown = set(chosen) - {c.key for c in CONFIGS}
    if unknown:
        raise SystemExit(f"overhead: unknown configuration(s) {', '.join(sorted(unknown))}")
    configs = [c for c in CONFIGS if c.key in chosen]
    workloads = []
    for spec in settings["workloads"]:
        framework, _, model = spec.partition(":")
        if framework not in ("pytorch", "tensorflow") or model not in (
                "small-cnn", "lstm", "resnet-50") or (
                model == "resnet-50" and framework != "pytorch"):
            raise SystemExit(f"overhead: {spec!r} is not FRAMEWORK:MODEL with FRAMEWORK "
                             "pytorch or tensorflow and MODEL small-cnn or lstm (or "
                             "pytorch:resnet-50)")
        workloads.append((framework, model))
    if settings["device"] not in ("cpu", "cuda"):
        raise SystemExit(f"overhead: --device {settings['device']!r}: cpu or cuda")
    if settings["device"] == "cpu":
        configs = [c for c in configs if not c.gpu_only]
    threads_list = list(dict.fromkeys(int(t) for t in settings["threads"]))

    result = Result(NAME, TITLE, __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
                    settings["smoke"], settings)
    jobs = [(f, m, t) for f, m in workloads for t in threads_list]
    plan = [[c for c in configs if not c.first_only or index == 0]
            for index in range(len(jobs))]
    compared = [c for c in configs if c.compared] if settings["compare"] else []
    progress = Progress(NAME, sum(map(len, plan)) + len(compared))
    busy = HostBusy()
    load_start = load_average()
    unavailable: dict[str, str] = {}
    busy.start()
    first: Measured | None = None
    for (framework, model, threads), chosen_configs in zip(jobs, plan, strict=True):
        label = f"{framework} {model}, {threads} thread{'s' if threads > 1 else ''}"
        progress.note(f"starting the {label} job")
        measured, missing = measure(settings, (framework, model, threads), chosen_configs,
                                    progress, label=label)
        unavailable.update(missing)
        first = first or measured
        add_workload(result, measured, configs)
    if compared and first is not None:
        with tempfile.TemporaryDirectory(prefix="overhead-compare-") as folder:
            code = _old_code(settings["compare"], Path(folder))
            label = f"{first.label}, at {settings['compare']}"
            progress.note(f"starting the {label} job")
            old, _ = measure(settings, jobs[0], compared, progress, code=code, label=label)
        add_comparison(result, settings["compare"], old, first)
    busy.stop()
    load_end = load_average()
    result.noise = {"host_busy_share": busy.shares[0] if busy.shares else None,
                    "load_average_start": load_start[0], "load_average_end": load_end[0]}
    result.noise_summary = (
        f"the machine's cores were {busy.shares[0]:.0%} busy over the run (the job "
        f"included); load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at "
        "the end. Each configuration is compared with its own off blocks, run between "
        "its on blocks, so what the machine does elsewhere widens the intervals rather "
        "than moving the medians." if busy.shares else "not measured")
    for key, why in unavailable.items():
        result.unavailable.append(f"{key}: {why}")
    if first is not None and "same" in first.pairs:
        result.resolution = _resolution(first.label, first.pairs["same"],
                                        int(settings["pairs"]))
    result.notes += [
        f"One intra-op thread leaves the other of this machine's {CORES} cores to the "
        "probe's thread and the harness, so it shows the probe's own cost; at the "
        "number of cores the probe's thread competes with OpenMP's, as on a fully used "
        "node.",
        "Step timing and --layers keep one session over all their on blocks, paused "
        "between them, as an agent keeps one for as long as the job runs; what a "
        "session's start and stop cost is the row with a session every block.",
        "A block's figure is its median step, robust to this machine's spikes, except for "
        "--layers at its duty cycle: it times one step in N, which a median would skip, "
        "so there it is the mean. The job's CPU per step is its process's CPU time (all "
        "threads: the probe's, OpenMP's) over the block's timed steps.",
        "The probe's own price is what it reports in dlprof_probe_cpu_seconds_total "
        "(hooks, layers, thread) over the on blocks, per step it counted: what a user "
        "reads on their own job. It leaves out what PyTorch itself spends because a "
        "module has a hook (its slower call path).",
        "TensorFlow's reference models train compiled (train_on_batch on a graph): "
        "--layers can time no single layer there, and its rows measure the hooks alone. "
        "The profiler row for TensorFlow is tf.profiler (start and stop around the "
        "block); torch.profiler records CPU activities.",
    ]
    return result
