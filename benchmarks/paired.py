"""Paired blocks inside one training job: the method the overhead benchmark and
gpu-check's overhead step share.

A job (benchmarks.training_job) runs blocks of steps on command. A pair is one
block with the measurement on and one with it off, back to back; successive
pairs swap the order (on-off, off-on, ...), so a drift of the machine that is
linear over two pairs cancels. The measurement is switched through the probe's
own protocol, as an agent would: a session started for the on block and
stopped after it, or one session kept and paused (``configure`` with
``paused``) between on blocks where its state must carry over (the duty cycle
of ``--layers`` learns its rate over many steps). While a block is on, the
harness polls the probe at the agent's interval, so the cost of the replies is
in. A block's figure is its median step, or its mean where only some steps
pay (the timed steps of a duty cycle: a median would skip them), and the
job's own CPU per step. A pair gives a
ratio, on over off; a configuration's result is the median of its pairs'
ratios with a percentile bootstrap interval (``common.median_interval``).
"""

from __future__ import annotations

import json
import random
import select
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import Processes, median_interval, percentile
from dlprof_agent.probe_link.client import ProbeClient, find_probe_socket

KEPT_SESSION_LEASE_SECONDS = 600.0  # a paused session waits out whole blocks
POLL_SECONDS = 1.0  # the agent's default interval


@dataclass(frozen=True)
class Block:
    seconds: list[float]  # each timed step
    cpu: float  # the job process's CPU over the timed steps, all its threads
    busy: float = 0.0  # a planted busy-wait's seconds over the timed steps

    @property
    def mean(self) -> float:
        return statistics.fmean(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def cpu_per_step(self) -> float:
        return self.cpu / len(self.seconds)


class TrainingJob:
    """A benchmarks.training_job process: blocks of steps on command."""

    def __init__(self, processes: Processes, framework: str, model: str, *, batch: int,
                 threads: int, warmup_seconds: float,
                 lstm: tuple[int, int, int] | None = None, code: Path | None = None,
                 device: str = "cpu") -> None:
        """``lstm``: vocabulary, hidden units and sequence length. ``code``: a folder
        holding another version's ``dlprof_agent`` package, which the job then
        imports (the harness stays this one)."""
        self.batch = batch
        sizes = [] if lstm is None else [
            "--vocabulary", str(lstm[0]), "--hidden", str(lstm[1]), "--sequence", str(lstm[2])]
        self.process = processes.start(
            [sys.executable, "-m", "benchmarks.training_job", "--framework", framework,
             "--model", model, "--batch", str(batch), "--threads", str(threads), *sizes,
             "--warmup-seconds", str(warmup_seconds),
             *(["--device", device] if device != "cpu" else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, code=code)
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

    def block(self, steps: int, *, settle: int = 0, mode: str = "plain") -> Block:
        """``settle`` untimed steps, then ``steps`` timed ones. ``mode``: plain,
        profiler, or planted=FRACTION (training_job's doc)."""
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(f"{settle} {steps} {mode}\n")
        stdin.flush()
        line = self._read_line(timeout=600)
        if not line:
            raise RuntimeError(f"the training job exited ({self.process.poll()})")
        data = json.loads(line)
        return Block(data["seconds"], data["cpu"], data.get("busy", 0.0))

    def run_block(self, steps: int, *, profiler: bool = False) -> list[float]:
        """Every step's time, none untimed (the scrape benchmark's blocks)."""
        return self.block(steps, mode="profiler" if profiler else "plain").seconds


class ProbeDriver:
    """The harness as the job's agent: switches the probe on and off through
    its protocol, and polls it while on."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._client: ProbeClient | None = None
        self._paused = False
        self._polling = threading.Event()
        self._off = threading.Event()
        self._lock = threading.Lock()
        self._closing = False
        self._poller = threading.Thread(target=self._poll, daemon=True)
        self._poller.start()
        self.own_cpu = 0.0  # the probe's own CPU, as it reported it, over the on blocks
        self.steps = 0  # the steady steps it counted meanwhile
        self._own_before = (0.0, 0)
        self._keep = False

    def on(self, options: dict[str, Any], *, keep: bool) -> None:
        """``keep``: one session for every on block, paused between them."""
        with self._lock:
            if self._client is None:
                path = find_probe_socket(self.pid)
                if path is None:
                    raise RuntimeError(f"the job {self.pid} has no probe socket")
                # The session is kept paused across other configurations' blocks, which
                # on a loaded machine outlast a lease drawn from the poll interval: the
                # probe then took the harness for gone and closed it (a broken pipe).
                self._client = ProbeClient.connect(self.pid, path, {
                    "interval_seconds": POLL_SECONDS, "warmup_steps": 0,
                    "lease_seconds": KEPT_SESSION_LEASE_SECONDS, **options})
            elif self._paused:
                self._request("configure", {"paused": False})
                self._paused = False
            self._own_before = self._own()
        self._keep = keep
        self._off.clear()
        self._polling.set()

    def off(self) -> None:
        self._polling.clear()
        self._off.set()
        with self._lock:
            if self._client is None:
                return
            cpu, steps = self._own()
            self.own_cpu += cpu - self._own_before[0]
            self.steps += steps - self._own_before[1]
            if self._keep:
                self._request("configure", {"paused": True})
                self._paused = True
            else:
                self.close()

    def close(self) -> None:
        client, self._client, self._paused = self._client, None, False
        if client is not None:
            client.stop()
            client.close()

    def finish(self) -> None:
        self._closing = True
        self._off.set()
        self._polling.set()
        with self._lock:
            self.close()

    def _own(self) -> tuple[float, int]:
        assert self._client is not None
        sample = self._client.snapshot()
        return sum(seconds for _, seconds in sample.cpu_seconds), sample.steady_steps

    def _request(self, command: str, args: dict[str, Any]) -> None:
        assert self._client is not None
        reply = self._client.request(command, args)
        if not reply.get("ok"):
            raise RuntimeError(f"the probe refused {command}: {reply.get('error')!r:.100}")

    def _poll(self) -> None:
        """A snapshot each POLL_SECONDS of on time: blocks are shorter than that."""
        due = POLL_SECONDS
        while True:
            self._polling.wait()
            if self._closing:
                return
            started = time.monotonic()
            if self._off.wait(max(0.0, due)):
                due -= time.monotonic() - started  # switched off first: carry the rest
                continue
            with self._lock:
                if self._client is not None and not self._off.is_set():
                    self._client.snapshot()
            due = POLL_SECONDS


@dataclass
class Pairs:
    """One configuration's pairs: on and off blocks, in the order they ran."""

    on: list[Block] = field(default_factory=list)
    off: list[Block] = field(default_factory=list)
    # A block's figure: its median step, robust to this machine's spikes, where
    # every step pays the same; its mean where only some do (a duty cycle).
    by_mean: bool = False

    def figure(self, block: Block) -> float:
        return block.mean if self.by_mean else block.median

    def ratios(self) -> list[float]:
        return [self.figure(a) / self.figure(b) - 1
                for a, b in zip(self.on, self.off, strict=True)]

    def cpu_ratios(self) -> list[float]:
        return [a.cpu_per_step / b.cpu_per_step - 1
                for a, b in zip(self.on, self.off, strict=True) if b.cpu > 0]

    def added(self) -> list[float]:
        """Seconds a step took longer on than off, per pair."""
        return [self.figure(a) - self.figure(b) for a, b in zip(self.on, self.off, strict=True)]

    def summary(self) -> dict[str, float]:
        wall, low, high = median_interval(self.ratios())
        cpu, cpu_low, cpu_high = median_interval(self.cpu_ratios() or [0.0])
        added, added_low, added_high = median_interval(self.added())
        return {"pairs": len(self.on),
                "step_off": statistics.median(self.figure(b) for b in self.off),
                "step_on": statistics.median(self.figure(b) for b in self.on),
                "wall": wall, "wall_low": low, "wall_high": high,
                "cpu": cpu, "cpu_low": cpu_low, "cpu_high": cpu_high,
                "added": added, "added_low": added_low, "added_high": added_high,
                "cpu_per_step_off": statistics.median(b.cpu_per_step for b in self.off),
                "busy_per_step": statistics.median(b.busy / len(b.seconds) for b in self.on),
                "block_iqr": statistics.median(
                    (percentile(b.seconds, 75) - percentile(b.seconds, 25))
                    / statistics.median(b.seconds) for b in self.off)}


def run_pairs(job: TrainingJob, pairs: int, steps: int, *, settle: int,
              switch_on: Callable[[], None], switch_off: Callable[[], None],
              mode: str = "plain", by_mean: bool = False,
              progress: Callable[[int], None] | None = None) -> Pairs:
    """``pairs`` pairs, the order swapped every pair; ``switch_on``/``off`` around
    each on block, ``mode`` for it (the job's own measurements)."""
    result = Pairs(by_mean=by_mean)
    for index in range(pairs):
        for on in ((True, False) if index % 2 == 0 else (False, True)):
            if on:
                switch_on()
                try:
                    result.on.append(job.block(steps, settle=settle, mode=mode))
                finally:
                    switch_off()
            else:
                result.off.append(job.block(steps, settle=settle))
        if progress is not None:
            progress(index)
    return result


def difference_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95,
                        resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """median(a) - median(b) with a percentile bootstrap interval, each side
    resampled on its own (two jobs, not paired)."""
    rng = random.Random(seed)
    differences = sorted(statistics.median(rng.choices(a, k=len(a)))
                         - statistics.median(rng.choices(b, k=len(b)))
                         for _ in range(resamples))
    tail = (1 - confidence) / 2 * 100
    return (statistics.median(a) - statistics.median(b), percentile(differences, tail),
            percentile(differences, 100 - tail))
