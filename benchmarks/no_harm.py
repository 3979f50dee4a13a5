"""Attaching never changes a job's results. Each kind of job of the reach table
(docs/reach.md), made deterministic and given a fixed number of steps, runs twice
untouched; then once per attach (`attach --layers`, started at one moment of the
run, spread over it, the last near its end) and in runs where agents are killed
(SIGKILL, with any gdb they started) at random instants of their injection. A run
is harmed when its final weights (sha256 of their bytes) or its exit code differ
from the untouched run's. Writes the section "## No harm" of docs/reach.md.

    python -m benchmarks.no_harm [--out docs/reach.md] [--attaches 4] [--kills 20] [KIND ...]

Each injector path that applies is run: the one attach picks (the agent's own
ptrace injector on x86-64 and arm64 before 3.14), and gdb, forced as it is on other CPUs (an
injecting agent whose plan_calls finds nothing; `attach --no-inject` then connects).
Each job is this module run with --job, in a process of its own. A run of a few
kinds updates their rows of the table and keeps the others.

Kept in one file: the jobs and the harness that starts them as this module share
the kinds' table, and the jobs' side imports nothing of the agent's."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import random
import re
import runpy
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "reach.md"
SECTION = "## No harm"
MACHINE_HEADING = "### On "  # a subsection per CPU: what harms a job depends on it
ATTACH_SECONDS = 5.0  # how long each agent stays attached (less when the job ends first)
START_SECONDS = 300.0  # a job's imports and first steps, on a loaded machine
# Kills land up to 1.2 times an uncut injection's length, or this: gdb's, where no
# thread waits in the kernel, is its whole 10 s wait for one.
KILL_WINDOW_SECONDS = 2.0


@dataclass(frozen=True)
class Kind:
    label: str  # a trainer's is its reach.TRAINERS key, whose script it runs
    steps: int
    needs: tuple[str, ...] = ("torch",)
    threads: int = 1  # OpenMP's, torch's intra-op
    pinned: bool = False
    trainer: bool = False


KINDS: dict[str, Kind] = {
    "pinned": Kind("pinned single-thread torch loop", 15000, pinned=True),
    "python": Kind("pure-Python loop, one thread", 800, needs=()),
    "openmp": Kind("torch on 2 OpenMP threads", 4000, threads=2),
    "dataloader": Kind("torch DataLoader with 2 forked workers (forked anew each epoch)", 3000),
    "waits": Kind("main in queue.get(), then join(), while a thread trains", 12000),
    "sleep": Kind("time.sleep(10 ms) each step", 800),
    "ddp": Kind("torchrun DDP job, 2 ranks (gloo), its rank 0", 800, trainer=True),
    "hf": Kind("Hugging Face Trainer, tiny BERT from its config", 500,
               ("transformers", "accelerate"), trainer=True),
    "lightning": Kind("Lightning Trainer", 1200, ("lightning",), trainer=True),
    "keras": Kind("Keras fit (compiled)", 2500, ("tensorflow", "keras"), trainer=True),
    "bf16": Kind("torch bf16 autocast (oneDNN: AVX-512 BF16 or AMX where the CPU has them)",
                 2500),
    "avx512": Kind("numpy float32 MLP (OpenBLAS and numpy kernels: AVX-512 where the CPU "
                   "has it)", 6000, ("numpy",)),
    "compile": Kind("torch.compile: a compiled module, and a train step compiled whole "
                    "(its digest holds dynamo's frames and every warning)", 3000),
}


# ---- the jobs: run in a process of their own (--job), with nothing of the agent loaded ----

def _mlp(width: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _train_step(model: Any, optimizer: Any, data: Any, target: Any,
                autocast: bool = False) -> None:
    import torch

    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss: Any = torch.nn.functional.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def _torch_loop(log: Any, width: int = 256, autocast: bool = False,
                sleep_seconds: float = 0.0) -> Any:
    import torch

    model, optimizer = _mlp(width)
    data, target = torch.randn(64, width), torch.randint(0, 10, (64,))
    while True:
        _train_step(model, optimizer, data, target, autocast)
        if sleep_seconds:
            time.sleep(sleep_seconds)
        if log.step_ended():
            return model


def _dataloader(log: Any, steps: int) -> Any:
    import torch

    model, optimizer = _mlp(256)

    class Samples(torch.utils.data.Dataset[tuple[Any, int]]):
        """Each sample made from its index alone: the same batches whichever worker."""

        def __len__(self) -> int:
            return 64 * 200

        def __getitem__(self, index: int) -> tuple[Any, int]:
            return torch.randn(256, generator=torch.Generator().manual_seed(index)), index % 10

    # Forked explicitly: 3.14's default, forkserver, cannot unpickle a local class.
    loader = torch.utils.data.DataLoader(Samples(), batch_size=64, num_workers=2,
                                         multiprocessing_context="fork")
    while True:
        for data, target in loader:
            _train_step(model, optimizer, data, target)
            if log.step_ended():
                return model


def _waits(log: Any, steps: int) -> Any:
    import queue

    import torch

    model, optimizer = _mlp(256)
    data, target = torch.randn(64, 256), torch.randint(0, 10, (64,))
    stepped: queue.Queue[bool] = queue.Queue()

    def train() -> None:
        while True:
            _train_step(model, optimizer, data, target)
            stop = log.step_ended()
            stepped.put(stop)
            if stop:
                return

    worker = threading.Thread(target=train)
    worker.start()
    # The first half of the run in queue.get(), the rest in join(): both lock waits.
    for _ in range(steps // 2):
        if stepped.get():
            break
    worker.join()
    return model


def _pure_python(log: Any, steps: int) -> list[float]:
    """A linear model fitted by gradient descent on Python floats, beside a sum of its
    squared errors (which grows on once the weights settle) and a logistic map (chaotic:
    a bit changed anywhere spreads)."""
    import math

    rows = [[math.sin(0.1 * i + j) for j in range(16)] for i in range(128)]
    targets = [sum(math.cos(j) * x for j, x in enumerate(row)) for row in rows]
    weights, squares, chaos = [0.0] * 16, 0.0, 0.5
    while True:
        for _ in range(40):
            gradient = [0.0] * 16
            for row, wanted in zip(rows, targets, strict=True):
                error = sum(w * x for w, x in zip(weights, row, strict=True)) - wanted
                squares += error * error
                for j, x in enumerate(row):
                    gradient[j] += error * x
            weights = [w - 0.001 * g for w, g in zip(weights, gradient, strict=True)]
            chaos = 3.99 * chaos * (1.0 - chaos)
        if log.step_ended():
            return [*weights, squares, chaos]


def _numpy_mlp(log: Any, steps: int) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 512), dtype=np.float32)
    y = rng.standard_normal((64, 10), dtype=np.float32)
    w1 = rng.standard_normal((512, 512), dtype=np.float32) * np.float32(0.05)
    w2 = rng.standard_normal((512, 10), dtype=np.float32) * np.float32(0.05)
    while True:
        hidden = np.tanh(x @ w1)
        error = (hidden @ w2 - y) / np.float32(len(x))
        w1 -= np.float32(0.01) * (x.T @ ((error @ w2.T) * (1 - hidden * hidden)))
        w2 -= np.float32(0.01) * (hidden.T @ error)
        if log.step_ended():
            return [w1, w2]


def _compiled(log: Any, steps: int) -> dict[str, Any]:
    """torch.compile as jobs use it, each step: a compiled module (dynamo's eager
    backend: its guards and frames without a compiler's minutes) trained around it,
    and a train step compiled whole with AOTAutograd (forward, loss and backward in one
    function), the optimizer's step after it. Beside the weights, what dynamo compiled
    and every warning raised: an attach that makes it compile again, or that warns on
    the job's stderr, changes the digest."""
    import warnings

    import torch
    from torch._dynamo.utils import counters

    module, module_optimizer = _mlp(256)
    compiled_module: Any = torch.compile(module, backend="eager")
    whole, whole_optimizer = _mlp(128)
    data, target = torch.randn(64, 256), torch.randint(0, 10, (64,))
    small = torch.randn(64, 128)

    def forward_backward(inputs: Any, labels: Any) -> Any:
        loss: Any = torch.nn.functional.cross_entropy(whole(inputs), labels)
        loss.backward()
        return loss

    compiled_step: Any = torch.compile(forward_backward, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while True:
            module_optimizer.zero_grad()
            loss: Any = torch.nn.functional.cross_entropy(compiled_module(data), target)
            loss.backward()
            module_optimizer.step()
            whole_optimizer.zero_grad()
            compiled_step(small, target)
            whole_optimizer.step()
            if log.step_ended():
                break
    said = sorted({f"{warning.category.__name__}: {warning.message}" for warning in caught})
    return {"model": torch.nn.ModuleList([module, whole]),
            "facts": json.dumps({"dynamo": dict(counters["stats"]), "warnings": said})}


BODIES: dict[str, Callable[[Any, int], Any]] = {
    "pinned": lambda log, steps: _torch_loop(log),
    "python": _pure_python,
    "openmp": lambda log, steps: _torch_loop(log, width=1024),
    "dataloader": _dataloader,
    "waits": _waits,
    "sleep": lambda log, steps: _torch_loop(log, sleep_seconds=0.01),
    "bf16": lambda log, steps: _torch_loop(log, width=512, autocast=True),
    "avx512": _numpy_mlp,
    "compile": _compiled,
}


def _state_bytes(model: Any) -> Iterator[bytes]:
    """The bytes of a model's state: a torch module's (a Lightning trainer's module),
    a Keras model's weights, numpy arrays, or Python floats."""
    model = getattr(model, "lightning_module", model)
    if isinstance(model, dict):  # weights, and facts a harm would change ("compile")
        yield from _state_bytes(model["model"])
        yield model["facts"].encode()
        return
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        for name, tensor in model.state_dict().items():
            yield name.encode()
            yield tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    elif hasattr(model, "get_weights"):
        yield from (weight.tobytes() for weight in model.get_weights())
    elif all(isinstance(value, float) for value in model):
        yield struct.pack(f"{len(model)}d", *model)
    else:
        yield from (array.tobytes() for array in model)


def weights_digest(model: Any) -> str:
    digest = hashlib.sha256()
    for chunk in _state_bytes(model):
        digest.update(chunk)
    return digest.hexdigest()


def say_weights(model: Any) -> None:
    """Print the digest in one write: a launcher's ranks share stdout, and torchrun's
    run unbuffered, where print() writes each piece apart."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"weights {weights_digest(model)}\n".encode())


def run_job(kind: str, steps: int, step_log_path: str, script: str | None) -> int:
    """Train ``kind`` for ``steps`` steps, each step's end logged to ``step_log_path``
    (tests/jobs/step_log.py, which the trainer tier's jobs use), then print the
    digest of its weights. A trainer is the trainer tier's job ``script``."""
    from tests.jobs import step_log

    step_log.enable_probe = lambda: None  # the probe is what the agent injects
    step_log.probe_steps = lambda: None  # nothing of the agent's loaded before it
    step_ended, done = step_log.StepLog.step_ended, step_log.StepLog.done

    def ended_after_the_last_step(log: step_log.StepLog) -> bool:
        step_ended(log)
        return log.steps >= steps

    def done_with_digest(log: step_log.StepLog, **facts: Any) -> None:
        done(log, **facts)
        caller = sys._getframe(1).f_locals  # the job's main(): its model, or trainer
        model = next(caller[name] for name in ("model", "trainer") if name in caller)
        say_weights(model)

    step_log.StepLog.step_ended = ended_after_the_last_step  # type: ignore[method-assign,assignment]
    never = f"{step_log_path}.never"
    if script is not None:
        step_log.StepLog.done = done_with_digest  # type: ignore[method-assign,assignment]
        sys.argv = [script, "--step-log", step_log_path, "--until", never,
                    "--max-seconds", "1e9"]
        runpy.run_path(script, run_name="__main__")  # ends in sys.exit(main())
        return 0
    if "torch" in KINDS[kind].needs:
        import torch

        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    log = step_log.StepLog(argparse.Namespace(step_log=step_log_path, until=never,
                                              max_seconds=1e9, batch=64), kind)
    model = BODIES[kind](log, steps)
    log.done()
    say_weights(model)
    return 0


# ---- the harness ----

@dataclass
class Outcome:
    exit_code: int | None  # None: it hung, and was killed
    weights: tuple[str, ...]  # each rank's digest
    seconds: float
    stderr: str

    def same_as(self, other: Outcome) -> bool:
        return self.exit_code == other.exit_code and self.weights == other.weights

    def said(self) -> str:
        code = "hung" if self.exit_code is None else f"exit {self.exit_code}"
        return f"{code}, weights {','.join(w[:12] for w in self.weights) or 'none'}"


class Job:
    """One run of a kind's job, in a session of its own, with its step log read as
    it grows."""

    def __init__(self, key: str, steps: int, folder: Path) -> None:
        kind = KINDS[key]
        self.folder = folder
        step_log = folder / "steps.log"
        command = [sys.executable, "-m", "benchmarks.no_harm", "--job", key,
                   "--steps", str(steps), "--step-log", str(step_log)]
        rank_suffix = ""
        if kind.trainer:
            from benchmarks import reach

            launcher = reach.LAUNCHERS.get(kind.label, [sys.executable])
            command = [*launcher, *command[1:], "--script", reach.TRAINERS[kind.label][0]]
            rank_suffix = reach.RANK_LOG_SUFFIX.get(kind.label, "")
        if kind.pinned:
            command = ["taskset", "-c", "0", *command]
        self.awaited = Path(f"{step_log}{rank_suffix}")
        self.ranked = bool(rank_suffix)
        self._read, self._steps = 0, 0
        env = {**_env(), "OMP_NUM_THREADS": str(kind.threads), "MKL_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONHASHSEED": "0",
               "PYTHONFAULTHANDLER": "1"}  # a crash's Python stack, for the evidence
        # Appended to: the ranks of a launcher's job share them, and would write over
        # each other's lines at one offset.
        self._stdout = open(folder / "stdout", "a+")  # noqa: SIM115 - closed by finish()
        self._stderr = open(folder / "stderr", "a+")  # noqa: SIM115
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._stdout,
                                        stderr=self._stderr, start_new_session=True)
        self.began = time.monotonic()

    def steps(self) -> int:
        """Steps logged so far (of rank 0, for a launcher's job)."""
        with contextlib.suppress(OSError), open(self.awaited, "rb") as log:
            log.seek(self._read)
            whole = log.read().rpartition(b"\n")[0]
            if whole:
                self._read += len(whole) + 1
                self._steps += whole.count(b'"step"')
        return self._steps

    def reach_step(self, step: int) -> bool:
        deadline = time.monotonic() + START_SECONDS
        while self.steps() < step:
            if self.process.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def target_pid(self) -> int:
        """The pid attached to: the job's, or its rank 0's (the step log's first line)."""
        if not self.ranked:
            return self.process.pid
        with open(self.awaited) as log:
            return int(json.loads(log.readline())["pid"])

    def alive(self) -> bool:
        return self.process.poll() is None

    def finish(self, timeout: float) -> Outcome:
        try:
            code: int | None = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        self.stop()
        self._stdout.seek(0)
        self._stderr.seek(0)
        weights = tuple(sorted(line.split()[1] for line in self._stdout.read().splitlines()
                               if line.startswith("weights ")))
        stderr = self._stderr.read()
        self._stdout.close()
        self._stderr.close()
        return Outcome(code, weights, time.monotonic() - self.began, stderr)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGCONT)  # were it left stopped
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)


def _env() -> dict[str, str]:
    """This environment, with this checkout first on the path (benchmarks, tests, the agent)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(REPO), os.environ.get("PYTHONPATH")]))}


# An agent that only injects the probe's bootstrap, as attach does, saying when its
# injection begins (its imports done): what is killed at random instants of it.
INJECTING_AGENT = """
import sys
from dlprof_agent.collectors.target import Target
from dlprof_agent.probe.bootstrap import injection_code
from dlprof_agent.reach import inject
if sys.argv[2] == "gdb":
    inject.plan_calls = lambda pid, runtime: None  # as on other CPUs: gdb makes the calls
code = injection_code()
print("injecting", flush=True)
queued = inject.inject(Target.of(int(sys.argv[1])), code)
print("queued" if queued is None else queued.state(), flush=True)
"""


def injecting_agent(pid: int, injector: str) -> subprocess.Popen[str]:
    """The agent, returned once its injection begins."""
    agent = subprocess.Popen([sys.executable, "-c", INJECTING_AGENT, str(pid), injector],
                             env=_env(), cwd="/", stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert agent.stdout is not None
    agent.stdout.readline()
    return agent


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(
                    int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_agent_side(agent: subprocess.Popen[str]) -> None:
    """SIGKILL the agent and all it started (gdb), stopped first so that it starts
    nothing more, as a cgroup kill does."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(agent.pid, signal.SIGSTOP)
    killed = [agent.pid, *descendants(agent.pid)]
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.wait(10)
    if agent.stdout is not None:
        agent.stdout.close()
    # A tracer lets go of its tracees only on its way out: a gdb that had read
    # libtorch's symbols takes a while to free them.
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs or dies yet; a zombie's tracees are free."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def left_stopped_or_traced(pid: int) -> str | None:
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, StopIteration):
            state = (task / "stat").read_text().rpartition(")")[2].split()[0]
            tracer = next(line.split()[1] for line in (task / "status").read_text()
                          .splitlines() if line.startswith("TracerPid:"))
            if state in ("t", "T") or tracer != "0":
                return f"thread {task.name} left {'stopped' if tracer == '0' else 'traced'}"
    return None


def default_injector(pid: int) -> str:
    """The injector attach uses for ``pid`` (inject.py's choice, before any call)."""
    from dlprof_agent.collectors.target import Target
    from dlprof_agent.reach.call_plan import plan_calls
    from dlprof_agent.reach.runtime import find_python_runtime

    target = Target.of(pid)
    runtime = find_python_runtime(target)
    if runtime is None:
        return "none: not Python"
    if runtime.version is not None and runtime.version >= (3, 14):
        return "PEP 768"
    # plan_calls finds nothing on a CPU the injector has no place for (cpus.py)
    return "ptrace" if plan_calls(target, runtime) is not None else "gdb (no ptrace plan)"


@dataclass
class Attach:
    step: int
    outcome: Outcome
    agent_said: str  # the injecting agent's output (gdb), then attach's

    @property
    def probe_up(self) -> bool:
        return "probe active in pid" in self.agent_said

    def why_not_up(self) -> str:
        """Why the probe did not come up: attach's reason, or the injecting agent's error."""
        reasons = [found.group(1) for found in (
            re.search(r"no in-process metrics .* for pid \d+: (.*)", line)
            or re.match(r"[\w.]+(?:Error|Failed|NotNow|NotFound|Refused|NotPython): (.*)", line)
            for line in self.agent_said.splitlines()) if found]
        if not reasons:
            return "no reason said"
        reason = re.sub(r"(pid|process) \d+", r"\1 N", reasons[-1])
        return reason.split("; the process, thread")[0][-200:]


@dataclass
class KillRun:
    kills: int
    delays: list[float]
    left: list[str]  # threads left stopped or traced, by kill
    outcome: Outcome


@dataclass
class Row:
    key: str
    injector: str = ""
    untouched: Outcome | None = None
    attaches: list[Attach] = field(default_factory=list)
    kill_runs: list[KillRun] = field(default_factory=list)
    injection_seconds: float | None = None  # the injecting agent's, uncut
    why_not: str = ""  # why the row was not measured

    def harms(self) -> list[str]:
        assert self.untouched is not None
        said = [f"attach at step {a.step}: {a.outcome.said()}" for a in self.attaches
                if not a.outcome.same_as(self.untouched)]
        for number, run in enumerate(self.kill_runs, 1):
            said += [f"kill run {number}: {left}" for left in run.left]
            if not run.outcome.same_as(self.untouched):
                said.append(f"kill run {number} ({run.kills} kills): {run.outcome.said()}")
        return said


def missing(key: str) -> str:
    kind = KINDS[key]
    absent = [name for name in kind.needs if importlib.util.find_spec(name) is None]
    if absent:
        return f"not installed: {', '.join(absent)}"
    if kind.pinned and shutil.which("taskset") is None:
        return "taskset is not installed"
    return ""


STARTED = time.monotonic()


def progress(text: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f} s] {text}", file=sys.stderr, flush=True)


def untouched(key: str, steps: int) -> tuple[Outcome, Outcome]:
    outcomes = []
    for _ in range(2):
        with tempfile.TemporaryDirectory(prefix="dlprof-no-harm-") as folder:
            job = Job(key, steps, Path(folder))
            outcomes.append(job.finish(START_SECONDS + 600))
        progress(f"{key}: untouched: {outcomes[-1].said()}, {outcomes[-1].seconds:.1f} s")
    return outcomes[0], outcomes[1]


def attach_run(key: str, steps: int, step: int, *, injector: str, timeout: float,
               row: Row) -> Attach | None:
    with tempfile.TemporaryDirectory(prefix="dlprof-no-harm-") as folder:
        job = Job(key, steps, Path(folder))
        try:
            if not job.reach_step(step):
                return None
            pid = job.target_pid()
            if not row.injector:
                row.injector = default_injector(pid) if injector == "default" else injector
            options = ["--layers", "--duration", f"{ATTACH_SECONDS:g}", "--port", "0",
                       "--grace", "0"]
            said = ""
            if injector == "gdb":
                agent = injecting_agent(pid, "gdb")
                said = agent.communicate(timeout=60)[0].strip() + "\n"
                options.append("--no-inject")
            with open(Path(folder) / "agent", "w+") as output:
                attached = subprocess.Popen([sys.executable, "-m", "dlprof_agent", "attach",
                                             str(pid), *options], env=_env(), cwd="/",
                                            stdout=output, stderr=subprocess.STDOUT)
                outcome = job.finish(timeout)
                try:
                    attached.wait(ATTACH_SECONDS + 60)
                except subprocess.TimeoutExpired:
                    attached.kill()
                    attached.wait()
                output.seek(0)
                said += output.read()
        finally:
            job.stop()
    return Attach(step, outcome, said)


def kill_runs(key: str, steps: int, *, injector: str, kills: int, per_run: int,
              timeout: float, rng: random.Random, row: Row) -> None:
    done = 0
    while done < kills:
        with tempfile.TemporaryDirectory(prefix="dlprof-no-harm-") as folder:
            job = Job(key, steps, Path(folder))
            run = KillRun(0, [], [], Outcome(None, (), 0.0, ""))
            measured = False
            try:
                if job.reach_step(max(1, steps // 20)):
                    pid = job.target_pid()
                    if row.injection_seconds is None:  # the injection's usual length, uncut
                        whole = injecting_agent(pid, "ptrace" if injector == "default"
                                                else injector)
                        began = time.monotonic()
                        whole.communicate(timeout=60)
                        row.injection_seconds = time.monotonic() - began
                        measured = True
                    while done < kills and (per_run == 0 or run.kills < per_run) and job.alive():
                        delay = rng.uniform(0.0, min(row.injection_seconds * 1.2,
                                                     KILL_WINDOW_SECONDS))
                        agent = injecting_agent(pid, "ptrace" if injector == "default"
                                                else injector)
                        time.sleep(delay)
                        kill_agent_side(agent)
                        run.kills += 1
                        done += 1
                        run.delays.append(delay)
                        time.sleep(0.3)
                        left = left_stopped_or_traced(pid) if job.alive() else None
                        if left is not None:
                            run.left.append(f"kill at {delay * 1000:.0f} ms: {left}")
                            # Said, and let go on: the run's result shows what else changed
                            os.kill(pid, signal.SIGCONT)
                run.outcome = job.finish(timeout)
            finally:
                job.stop()
        progress(f"{key} ({injector}): {run.kills} kills "
                 f"({', '.join(f'{d * 1000:.0f}' for d in run.delays)} ms): "
                 f"{run.outcome.said()}{'; ' + '; '.join(run.left) if run.left else ''}")
        if row.untouched is not None and not run.outcome.same_as(row.untouched):
            progress(f"{key}: job's stderr: {run.outcome.stderr[-2000:]}")
        if run.kills:
            row.kill_runs.append(run)
        elif not measured:
            row.why_not = "the job ended before any kill"
            return


def moments(steps: int, count: int) -> list[int]:
    """``count`` steps to attach at: spread from 10% to 90% of the run, and the last
    step, whose attach meets the job as it ends (its teardown, the interpreter's
    finalization, the exit handlers of its libraries)."""
    spread = count - 1
    fractions = [0.1 + 0.8 * index / (spread - 1) for index in range(spread)] if spread > 1 \
        else [0.5] * spread
    return [max(1, round(steps * fraction)) for fraction in fractions] + [steps]


def measure(key: str, *, attaches: int, kills: int, kills_per_run: int = 0,
            injectors: tuple[str, ...] = ("default", "gdb"), scale: float = 1.0,
            seed: int = 0) -> list[Row]:
    """The rows of ``key``, one per injector: its attaches and kills against its untouched run."""
    why = missing(key)
    if why:
        return [Row(key, injector, why_not=why) for injector in injectors]
    steps = max(20, round(KINDS[key].steps * scale))
    first, second = untouched(key, steps)
    if not first.same_as(second) or first.exit_code != 0 or not first.weights:
        why = (f"not deterministic: untouched runs ended {first.said()} and {second.said()}"
               if first.exit_code == 0 else f"untouched run failed: {first.said()}: "
               f"{first.stderr[-300:]}")
        return [Row(key, injector, first, why_not=why) for injector in injectors]
    timeout = 3 * max(first.seconds, second.seconds) + 120
    rows = []
    for injector in injectors:
        row = Row(key, untouched=first)
        if injector == "gdb" and shutil.which("gdb") is None:
            row.why_not = "gdb is not installed"
        for step in moments(steps, attaches) if not row.why_not else []:
            attached = attach_run(key, steps, step, injector=injector, timeout=timeout,
                                  row=row)
            if attached is None:
                progress(f"{key} ({injector}): the job ended before step {step}")
                continue
            row.attaches.append(attached)
            if not attached.outcome.same_as(first):
                progress(f"{key}: agent said: {attached.agent_said[-600:]}\n"
                         f"job's stderr: {attached.outcome.stderr[-2000:]}")
            progress(f"{key} ({row.injector}): attach at step {step}/{steps}: "
                     f"{attached.outcome.said()}, {attached.outcome.seconds:.1f} s, probe "
                     f"{'up' if attached.probe_up else 'not up'}; "
                     f"{'same' if attached.outcome.same_as(first) else 'HARMED'}")
        if not row.why_not:
            kill_runs(key, steps, injector=injector, kills=kills, per_run=kills_per_run,
                      timeout=timeout, rng=random.Random(f"{seed}-{key}-{injector}"), row=row)
        row.injector = row.injector or injector
        rows.append(row)
    return rows


# ---- the section ----

def instruction_sets(flags: set[str]) -> str:
    """What of the register state's wide parts the CPU has (cpuinfo's flags), in words."""
    if "avx512f" not in flags:
        return "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
    extras = [name for flag, name in (("avx512_bf16", "BF16"), ("avx512_fp16", "FP16"))
              if flag in flags]
    wide = "AVX-512" + (f" with {' and '.join(extras)}" if extras else "")
    return f"AMX and {wide}" if "amx_tile" in flags else f"{wide}, no AMX"


def arm64_features(features: set[str]) -> str:
    """What of arm64's register state the CPU has (cpuinfo's Features), in words."""
    found = [next((name for flag, name in choices if flag in features), "")
             for choices in ((("sve2", "SVE2"), ("sve", "SVE")), (("sme2", "SME2"), ("sme", "SME")),
                             (("paca", "PAC"),), (("bti", "BTI"),))]
    return ", ".join(name for name in found if name) or "FP/SIMD only"


def machine() -> tuple[str, list[str]]:
    """This machine's subsection heading (its CPU) and the lines that describe it."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    found = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", cpuinfo, re.M)
    flags = set(found.group(1).split()) if found else set()
    arm64 = platform.machine() in ("aarch64", "arm64")
    wide = ("sve", "sme", "pac", "bti") if arm64 else ("avx512", "amx", "xsave")
    wanted = sorted(flag for flag in flags if flag.startswith(wide))
    probe = ("import json, importlib.util as u\nfound = {}\n"
             "if u.find_spec('torch'):\n    import torch\n"
             "    found['torch'] = torch.__version__ + ', CPU capability ' + "
             "torch.backends.cpu.get_cpu_capability()\n"
             "if u.find_spec('numpy'):\n    import numpy\n"
             "    try:\n        from numpy._core._multiarray_umath import __cpu_features__ as f\n"
             "    except ImportError:\n"
             "        from numpy.core._multiarray_umath import __cpu_features__ as f\n"
             "    found['numpy'] = numpy.__version__ + ', dispatches ' + (' '.join("
             "k for k, v in f.items() if v and k.startswith('AVX512')) or 'no AVX512')\n"
             "print(json.dumps(found))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, check=False)
    versions = json.loads(done.stdout or "{}") if done.returncode == 0 else {}
    name = model.group(1) if model else platform.processor() or platform.machine()
    sets = arm64_features(flags) if arm64 else instruction_sets(flags)
    return (f"{MACHINE_HEADING}{name}, {sets}",
            [f"CPU: {name}, {os.cpu_count()} CPUs; flags: "
             f"{' '.join(wanted) or 'none of ' + ', '.join(f'{flag}*' for flag in wide)}.",
             f"Linux {platform.release()}, Python {platform.python_version()} "
             f"({platform.machine()})" + "".join(f"; {name} {text}"
                                                 for name, text in versions.items()) + "."])


def _cell(good: int, total: int) -> str:
    return f"{good}/{total}" if total else "-"


def section(rows: list[Row], attaches: int, kills: int, seconds: float,
            machine_said: tuple[str, list[str]]) -> str:
    """The section: what was done, then this machine's subsection (``machine_said``:
    machine()'s heading and lines) with its table."""
    heading, described = machine_said
    lines = [
        SECTION, "",
        "Written by `python -m benchmarks.no_harm` (a few cheap kinds are checked by "
        "`tests/test_no_harm.py`), a subsection per CPU. Each kind of job trains a fixed "
        "number of steps from fixed seeds, on in-memory data, on one intra-op thread "
        "unless said, and prints the sha256 of its final weights; run twice untouched, "
        "both must agree. Then runs each with one "
        f"`attach --layers --duration {ATTACH_SECONDS:g}` started once the job has logged "
        "a given step: spread from 10% to 90% of the run, and its last step (that agent "
        "meets the job as it ends: its teardown, the interpreter's finalization, its "
        "libraries' exit handlers). Then kills (SIGKILL of an agent injecting the probe, "
        "and of its gdb, at a random instant of its injection: 0 to 1.2 times its uncut "
        f"length, at most {KILL_WINDOW_SECONDS:g} s) in as many runs as they took, one "
        "after the other in each, the first run's first injection uncut. A run is "
        "identical when its weights and exit code are the untouched run's; a kill counts "
        "as identical when its run is and it left no thread stopped or traced. The gdb "
        "rows force the injector used on CPUs without a place of its own: an agent "
        "whose `plan_calls` finds nothing injects, then `attach --no-inject` connects. "
        "gdb's calls return to a breakpoint of its own, in the job for the milliseconds "
        "of each call: a kill of gdb inside that window kills the job (reach/gdb.py), "
        "and a kill of agent and gdb together (a cgroup's) can leave a thread stopped; "
        "the ptrace injector has neither window.",
        "",
        heading, "",
        *described,
        f"Each row: {attaches} attaches, {kills} kills.",
        "",
        "| kind of job | injector | attaches identical | exit codes unchanged | "
        "kills identical | notes |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        label = KINDS[row.key].label
        if row.why_not and not row.attaches and not row.kill_runs:
            lines.append(f"| {label} | {row.injector} | - | - | - | {row.why_not} |")
            continue
        assert row.untouched is not None
        reference = row.untouched
        same_attaches = sum(a.outcome.same_as(reference) for a in row.attaches)
        outcomes = [a.outcome for a in row.attaches] + [r.outcome for r in row.kill_runs]
        same_codes = sum(o.exit_code == reference.exit_code for o in outcomes)
        kill_total = sum(r.kills for r in row.kill_runs)
        kill_same = sum(r.kills - len(r.left) for r in row.kill_runs
                        if r.outcome.same_as(reference))
        notes = [f"untouched {reference.seconds:.0f} s",
                 f"probe up {sum(a.probe_up for a in row.attaches)}/{len(row.attaches)}",
                 *sorted({f"not up: {a.why_not_up()}" for a in row.attaches
                          if not a.probe_up and a.step < row.attaches[-1].step}),
                 f"kills in {len(row.kill_runs)} runs"]
        if row.injection_seconds is not None:
            notes.append(f"injection {row.injection_seconds * 1000:.0f} ms")
        notes += [*row.harms(), *([row.why_not] if row.why_not else [])]
        lines.append(f"| {label} | {row.injector} | {_cell(same_attaches, len(row.attaches))} "
                     f"| {_cell(same_codes, len(outcomes))} | {_cell(kill_same, kill_total)} | "
                     + "; ".join(notes).replace("|", "/") + " |")
    ran = sorted({row.key for row in rows}, key=list(KINDS).index)
    lines += ["", f"The whole matrix took {seconds / 60:.0f} minutes." if len(ran) == len(KINDS)
              else f"This run ({', '.join(ran)}) took {seconds / 60:.0f} minutes; rows of "
                   "other kinds are kept from earlier runs on this CPU."]
    return "\n".join(lines) + "\n"


def with_section(text: str, new: str) -> str:
    """``text`` with its No harm section replaced by ``new``, or ``new`` added at the
    end. Other CPUs' subsections are kept; in this CPU's, rows of the old table whose
    kind and injector ``new`` lacks are kept (a run of a few kinds updates theirs), in
    the order of ``KINDS``."""
    parts = re.split(r"(?m)^(?=## )", text)
    old = next((part for part in parts if part.startswith(SECTION)), None)
    if old is None:
        return (text.rstrip("\n") + "\n\n" + new) if text.strip() else new
    preamble, made = _subsections(new)
    blocks = _subsections(old)[1]
    for heading, block in made.items():
        blocks[heading] = _merged(blocks.get(heading, ""), block)
    merged = "\n\n".join([preamble.rstrip("\n"),
                          *(block.rstrip("\n") for block in blocks.values())]) + "\n"
    return "".join(merged + ("\n" if part.endswith("\n\n") else "") if part is old else part
                   for part in parts)


def _subsections(section: str) -> tuple[str, dict[str, str]]:
    """A No harm section's text before its first CPU, and its CPUs' subsections by
    heading (each with its heading line)."""
    pieces = re.split(rf"(?m)^(?={re.escape(MACHINE_HEADING)})", section)
    return pieces[0], {piece.splitlines()[0]: piece for piece in pieces[1:]}


def _merged(old: str, new: str) -> str:
    """A CPU's subsection ``new``, with the rows of ``old`` it lacks kept."""
    rows = {**_table_rows(old), **_table_rows(new)}
    order = {KINDS[key].label: index for index, key in enumerate(KINDS)}
    kept = [rows[key] for key in sorted(rows, key=lambda key: (  # attach's injector first
        order.get(key[0], len(order)), key[1] == "gdb", key[1]))]
    lines = new.splitlines()
    table_at = next(index for index, line in enumerate(lines) if line.startswith("|---"))
    tail = [line for line in lines[table_at + 1:] if not line.startswith("| ")]
    return "\n".join([*lines[:table_at + 1], *kept, *tail]) + "\n"


def _table_rows(section: str) -> dict[tuple[str, str], str]:
    """The table's lines of a section, by their kind of job and injector."""
    rows = {}
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| kind of job |"):
            cells = line.split("|")
            rows[cells[1].strip(), cells[2].strip()] = line
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.no_harm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kinds", nargs="*", metavar="KIND",
                        help=f"default: every kind ({', '.join(KINDS)})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--attaches", type=int, default=4)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--kills-per-run", type=int, default=0, metavar="N",
                        help="at most N kills in one run (default: as many as it lasts for)")
    parser.add_argument("--injectors", default="default,gdb",
                        help="default (attach's own choice) and/or gdb (forced)")
    parser.add_argument("--scale", type=float, default=1.0, help="times each kind's steps")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # in the job's process: run KIND
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--step-log", help=argparse.SUPPRESS)
    parser.add_argument("--script", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        return run_job(args.job, args.steps, args.step_log, args.script)
    unknown = [kind for kind in args.kinds if kind not in KINDS]
    if unknown:
        parser.error(f"unknown kinds {unknown}: choose from {', '.join(KINDS)}")
    began = time.monotonic()
    rows = []
    for key in args.kinds or KINDS:
        rows += measure(key, attaches=args.attaches, kills=args.kills,
                        kills_per_run=args.kills_per_run,
                        injectors=tuple(args.injectors.split(",")), scale=args.scale)
        for row in rows[-len(args.injectors.split(",")):]:
            harms = row.harms() if row.untouched and not row.why_not else []
            progress(f"{key} ({row.injector}): {row.why_not or 'done'}; "
                     f"{len(harms)} harms" + "".join(f"\n    {h}" for h in harms))
    text = args.out.read_text() if args.out.exists() else ""
    args.out.write_text(with_section(text, section(rows, args.attaches, args.kills,
                                                   time.monotonic() - began, machine())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
