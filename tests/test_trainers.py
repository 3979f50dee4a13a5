"""The trainers tier: `attach --layers` to real third-party trainers on small
in-memory data (tests/jobs/: Hugging Face Trainer on accelerate, Lightning
Trainer.fit, Keras fit compiled and eager, a manual-SGD loop without torch.optim,
a train step compiled whole with torch.compile, a torchrun DDP job of two gloo
ranks) and hold what the agent exports to what the
job itself measured, over the same steps:

- the probe is up;
- step time and samples/s are within 2% of the job's own timer (a callback of
  each trainer logs every step's end with the probe's step count at that moment);
- the phases are disjoint and sum to 100 +- 2% of the step time;
- no finding fires on these healthy jobs;
- layer names are readable (module paths, not <lambda> or object reprs).

Each trainer's figures go into a table, docs/trainers.md, written by this module
whether its checks pass or not, so the table says what failed. A trainer whose
package is not installed is skipped, with the package named."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, agent_env, free_port, http_get, wait_for

# One worker runs them all: its module fixture writes the whole table, once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trainers")]

TABLE = REPO / "docs" / "trainers.md"
TOLERANCE = 0.02  # step time and samples/s against the job's own timer; the split's sum
WARMUP_STEPS = 5
# The window compared: at least this many steady steps, and long enough for the
# findings to have judged (a 3 s window, raised after holding for a few seconds).
MIN_WINDOW_STEPS = 40
MIN_WINDOW_SECONDS = 12.0
UNREADABLE_LAYER = re.compile(r"<|>|object at|0x[0-9a-fA-F]{4,}")
# Findings whose cause is the host, not the job: a machine busy with other work
# starves any job on it, and saying so is right. Shown in the table, not failed.
HOST_FINDINGS = frozenset({"cpu_contention"})


@dataclass(frozen=True)
class Trainer:
    name: str
    command: tuple[str, ...]  # after the interpreter
    packages: tuple[str, ...]  # importable modules it needs
    install: str  # what to install when one is missing
    ranks: int = 1
    phases: tuple[str, ...] = ()  # phases its split must have, beyond the sum


TRAINERS = (
    Trainer("hf_trainer", ("tests/jobs/hf_trainer.py",), ("transformers", "accelerate"),
            "transformers accelerate"),
    Trainer("lightning", ("tests/jobs/lightning_fit.py",), ("lightning",), "lightning"),
    Trainer("keras_compiled", ("tests/jobs/keras_fit.py",), ("tensorflow", "keras"),
            "tensorflow-cpu"),
    Trainer("keras_eager", ("tests/jobs/keras_fit.py", "--eager"), ("tensorflow", "keras"),
            "tensorflow-cpu"),
    Trainer("manual_sgd", ("tests/jobs/manual_sgd.py",), ("torch",), "torch"),
    Trainer("compiled_step", ("tests/jobs/compiled_step.py",), ("torch",), "torch",
            phases=("compiled", "optimizer")),
    Trainer("torchrun_ddp", ("-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--standalone", "tests/jobs/torch_ddp.py"), ("torch",), "torch",
            ranks=2),
)


# ---- reading /metrics ---------------------------------------------------------------------------


Series = list[tuple[str, dict[str, str], float]]


def parse(exposition: str) -> Series:
    return [(sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(exposition)
            for sample in family.samples]


def total(series: Series, name: str, **labels: str) -> float:
    return sum(value for each, found, value in series
               if each == name and all(found.get(k) == v for k, v in labels.items()))


def by_label(series: Series, name: str, label: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for each, found, value in series:
        if each == name and label in found:
            values[found[label]] = values.get(found[label], 0.0) + value
    return values


@dataclass(frozen=True)
class ProbeTotals:
    """One scrape's probe figures for the target."""

    steps: int  # warm-up and steady: the probe's count of step boundaries
    steady_steps: int
    step_seconds: float  # steady steps' sum
    steady_samples: float
    phases: dict[str, float]
    raised: frozenset[str]  # findings at 1
    judged: frozenset[str]  # findings with a series
    layers: frozenset[str]
    layer_timing: str  # the probe's setting: "on", "eager", or why it is unavailable

    @classmethod
    def of(cls, series: Series) -> ProbeTotals:
        findings = {found["finding"]: value for name, found, value in series
                    if name == "dlprof_finding"}
        return cls(
            steps=int(total(series, "dlprof_steps_total")),
            steady_steps=int(total(series, "dlprof_steps_total", phase="steady")),
            step_seconds=total(series, "dlprof_step_duration_seconds_sum"),
            steady_samples=total(series, "dlprof_samples_total", phase="steady"),
            phases=by_label(series, "dlprof_step_phase_seconds_total", "phase"),
            raised=frozenset(f for f, value in findings.items() if value == 1),
            judged=frozenset(findings),
            layers=frozenset(by_label(series, "dlprof_layer_seconds_total", "layer")),
            layer_timing=next((found.get("layer_timing", "") for name, found, _ in series
                               if name == "dlprof_framework_info"), ""))


# ---- one trainer, measured --------------------------------------------------------------------


@dataclass
class Measured:
    trainer: str
    probe_up: bool = False
    probe_step_seconds: float = math.nan
    job_step_bounds: tuple[float, float] = (math.nan, math.nan)  # see job_window
    probe_samples_per_second: float = math.nan
    job_rate_bounds: tuple[float, float] = (math.nan, math.nan)
    steps: int = 0
    split: dict[str, float] = field(default_factory=dict)  # share of the step time
    raised: set[str] = field(default_factory=set)
    judged: frozenset[str] = frozenset()
    layers: frozenset[str] = frozenset()
    layer_timing: str = ""
    failures: list[str] = field(default_factory=list)

    def check(self) -> None:
        """Every assertion of the tier, collected (the table shows them all)."""
        fail = self.failures.append
        if not self.probe_up:
            fail("probe not up")
        step_error = outside(self.probe_step_seconds, self.job_step_bounds)
        if not abs(step_error) <= TOLERANCE:
            fail(f"step time {step_error:+.1%} against the job's")
        rate_error = outside(self.probe_samples_per_second, self.job_rate_bounds)
        if not abs(rate_error) <= TOLERANCE:
            fail("no samples/s" if not self.probe_samples_per_second
                 or math.isnan(self.probe_samples_per_second)
                 else f"samples/s {rate_error:+.1%} against the job's")
        split_sum = sum(self.split.values())
        if not abs(split_sum - 1) <= TOLERANCE:
            fail(f"split sums to {split_sum:.0%}")
        if any(share < 0 for share in self.split.values()):
            fail("a phase went backwards")
        if self.raised - HOST_FINDINGS:
            fail("findings fired: " + ", ".join(sorted(self.raised - HOST_FINDINGS)))
        unreadable = sorted(name for name in self.layers if UNREADABLE_LAYER.search(name))
        if not self.layers and not self.layer_timing.startswith("unavailable"):
            fail("no layer times")
        elif unreadable:
            fail("unreadable layer names: " + ", ".join(unreadable[:3]))


def job_log(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def outside(value: float, bounds: tuple[float, float]) -> float:
    """How far ``value`` lies outside ``bounds``, relative to the nearer bound
    (0 inside, nan when either is unknown)."""
    low, high = bounds
    if value < low:
        return value / low - 1
    if value > high:
        return value / high - 1
    return 0.0 if low <= value <= high else math.nan


def boundary_between(log: list[dict[str, object]], probe_steps: int) -> tuple[float, float]:
    """When the probe's ``probe_steps``-th step ended, as the job's own timer can
    place it: after the end of the job's step before the first one that logged
    that count, and no later than that step's end. The probe closes a step where
    its source sees one (a Keras train_function's start, an optimizer's step's
    end), which lies somewhere inside the job's step: a step of 0.5 s at an
    epoch's turn on the window's edge, counted by one and not the other, is 4% of
    a 12 s window (compiled Keras fit, 4.7 against 4.5 ms, before this)."""
    ends = [entry for entry in log if "end" in entry]
    for index, entry in enumerate(ends):
        counted = entry.get("probe_steps")
        if isinstance(counted, int) and counted >= probe_steps:
            assert index > 0, f"the probe counted {probe_steps} at the job's first logged step"
            before, end = ends[index - 1]["end"], entry["end"]
            assert isinstance(before, float) and isinstance(end, float)
            return before, end
    raise AssertionError(f"the job logged no step the probe counted as {probe_steps}")


def job_window(log: list[dict[str, object]], first: int, last: int) -> tuple[float, float]:
    """The shortest and longest the job's timer allows for the probe's steps
    ``first`` (its count at the window's start) to ``last``."""
    start_earliest, start_latest = boundary_between(log, first)
    end_earliest, end_latest = boundary_between(log, last)
    return end_earliest - start_latest, end_latest - start_earliest


def measure(trainer: Trainer, tmp_path: Path,
            processes: list[subprocess.Popen[bytes]]) -> Measured:
    # A probe runtime dir of its own: no other agent on the machine finds the job.
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    agent_environment = {**agent_env(), "DLPROF_AGENT_RUNTIME_DIR": str(runtime_dir)}
    env = {**agent_environment, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                      os.environ.get("PYTHONPATH")]))}
    step_log, stop = tmp_path / "steps.log", tmp_path / "stop"
    with open(tmp_path / "job.out", "wb") as output:
        job = subprocess.Popen([sys.executable, *trainer.command, "--step-log", str(step_log),
                                "--until", str(stop)], cwd=REPO, env=env, stdout=output,
                               stderr=subprocess.STDOUT, start_new_session=True)
    processes.append(job)
    # Rank 0 of a distributed job, or the job itself.
    log_path = step_log.with_name(step_log.name + ".0") if trainer.ranks > 1 else step_log
    wait_for(lambda: job.poll() is None and sum("step" in e for e in job_log(log_path)) >= 3,
             f"{trainer.name} training", 240)
    pid = job_log(log_path)[0]["pid"]
    port = free_port()
    with open(tmp_path / "agent.err", "wb") as agent_err:
        agent = subprocess.Popen(
            [sys.executable, "-m", "dlprof_agent", "attach", str(pid), "--layers",
             "--no-inject", "--port", str(port), "--interval", "0.5", "--quiet", "--no-gpu",
             "--warmup-steps", str(WARMUP_STEPS), "--grace", "0"],
            cwd=REPO, env=agent_environment, stderr=agent_err)
    processes.append(agent)
    measured = Measured(trainer.name)
    try:
        def scrape() -> Series:
            return parse(http_get(f"http://127.0.0.1:{port}/metrics").decode())

        first = wait_for(lambda: (s := scrape()) and total(s, "dlprof_probe_up") == 1
                         and total(s, "dlprof_steps_total", phase="steady") >= 2 and s,
                         f"steady steps of {trainer.name} on /metrics", 120)
        measured.probe_up = True
        before = ProbeTotals.of(first)
        started = time.monotonic()
        deadline = started + 180
        while True:
            latest = ProbeTotals.of(scrape())
            measured.raised |= latest.raised
            if (latest.steady_steps - before.steady_steps >= MIN_WINDOW_STEPS
                    and time.monotonic() - started >= MIN_WINDOW_SECONDS):
                break
            assert time.monotonic() < deadline, f"{trainer.name} made too few steps"
            time.sleep(0.5)
    finally:
        stop.touch()
        try:
            job.wait(120)
        finally:
            agent.send_signal(signal.SIGINT)
            agent.wait(30)
    after = latest
    log = job_log(log_path)
    steps = after.steady_steps - before.steady_steps
    assert after.steps - before.steps == steps, "warm-up steps inside the window"
    shortest, longest = job_window(log, before.steps, after.steps)
    probe_seconds = after.step_seconds - before.step_seconds
    batch = log[0]["batch"]
    assert isinstance(batch, int)
    measured.steps = steps
    measured.probe_step_seconds = probe_seconds / steps
    measured.job_step_bounds = (shortest / steps, longest / steps)
    measured.probe_samples_per_second = (after.steady_samples - before.steady_samples) \
        / probe_seconds
    measured.job_rate_bounds = (batch * steps / longest, batch * steps / shortest)
    measured.split = {phase: (seconds - before.phases.get(phase, 0.0)) / probe_seconds
                      for phase, seconds in after.phases.items()}
    measured.judged = after.judged
    measured.layers = after.layers
    measured.layer_timing = after.layer_timing
    return measured


# ---- the table ----------------------------------------------------------------------------------


RESULTS: dict[str, Measured] = {}


def _span(bounds: tuple[float, float], decimals: int) -> str:
    """The job's figure: one number, or its bounds where they differ as shown."""
    low, high = (f"{value:.{decimals}f}" for value in bounds)
    return low if low == high else f"{low}-{high}"


def _row(measured: Measured) -> str:
    split = ", ".join(f"{phase} {share:.0%}" for phase, share in
                      sorted(measured.split.items(), key=lambda item: -item[1])) or "-"
    low, high = measured.job_step_bounds
    step = (f"{measured.probe_step_seconds * 1e3:.1f} / {_span((low * 1e3, high * 1e3), 1)}"
            if measured.steps else "-")
    job_rate = _span(measured.job_rate_bounds, 0)
    rate = (f"{measured.probe_samples_per_second:.0f} / {job_rate}"
            if measured.steps and measured.probe_samples_per_second else f"none / {job_rate}")
    findings = ", ".join(f"{f} (the host)" if f in HOST_FINDINGS else f
                         for f in sorted(measured.raised)) or "none"
    result = "pass" if not measured.failures else "; ".join(measured.failures)
    return (f"| {measured.trainer} | {split} (sum {sum(measured.split.values()):.0%}) | "
            f"{step} | {rate} | {measured.steps} | {findings} | {result} |")


@pytest.fixture(scope="module", autouse=True)
def table() -> Iterator[None]:
    yield
    if not RESULTS:
        return
    lines = [
        "# The trainers tier",
        "",
        "Written by `tests/test_trainers.py` (`pytest -m slow tests/test_trainers.py`):",
        "`attach --layers` to real third-party trainers on small in-memory data, on",
        "one CPU thread each, compared with each job's own step timer over the same",
        "steady steps (a callback logs every step's end). Step time and samples/s:",
        "the agent's / the job's. The job's timer places the window's edges only to",
        "within a step (the agent closes a step where its trainer's hook sees one),",
        "so its figure is a range where an edge step was long, such as an epoch's",
        "turn. A check passes within 2% of that range; the split must sum to",
        "100 +- 2%, no finding may fire (but those whose cause is the host, such as",
        "`cpu_contention` on a shared machine), and layer names must be readable.",
        "",
        "| trainer | split of the step (agent) | step ms: agent / job | samples/s: "
        "agent / job | steps | findings | result |",
        "|---|---|---|---|---|---|---|",
        *(_row(RESULTS[t.name]) for t in TRAINERS if t.name in RESULTS),
        "",
    ]
    TABLE.write_text("\n".join(lines))


@pytest.mark.parametrize("trainer", TRAINERS, ids=[t.name for t in TRAINERS])
def test_attach_with_layers_tells_the_truth_about_a_real_trainer(
        trainer: Trainer, tmp_path: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    missing = [name for name in trainer.packages if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: pip install {trainer.install} "
                    "(scripts/setup installs it)")
    measured = measure(trainer, tmp_path, processes)
    measured.check()
    if trainer.ranks > 1 and not measured.split.get("exchange"):
        # Its ranks wait in the all-reduce: that time is exchange, never input (and
        # input_bound, which may judge such a rank once it is, must not fire).
        measured.failures.append("no exchange in the split of a rank of a process group")
    measured.failures.extend(f"no {phase} in the split" for phase in trainer.phases
                             if not measured.split.get(phase))
    RESULTS[trainer.name] = measured
    assert not measured.failures, _row(measured)
