"""What every benchmark shares: options with a full and a smoke default, the
machine's description, statistics, processes that are always stopped, a lean
HTTP scraper, progress on stderr, and the result written as Markdown and JSON."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from dlprof_agent.cli.arguments import whole_number

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "results"
SMOKE_OUT = REPO / "build" / "benchmarks-smoke"  # ignored by git: smoke figures mean nothing
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1

# What Prometheus 2.x sends: exporters that can gzip, or speak OpenMetrics, do.
PROMETHEUS_HEADERS = (
    "Accept: application/openmetrics-text;version=1.0.0;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,"
    "*/*;q=0.2\r\nAccept-Encoding: gzip\r\n")


# Options: each has a full default and a smoke default.

@dataclass(frozen=True)
class Option:
    flag: str
    full: Any
    smoke: Any
    help: str
    type: Callable[[str], Any] = str
    metavar: str | None = None
    shown: str | None = None  # the full default in words, where its value is the machine's

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _shown(value: Any) -> str:
    if value is None:
        return "all"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers, e.g. 1,4,16"
                                         ) from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give non-negative integers, e.g. 1,4,16")
    return values


def float_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of numbers, e.g. 1,0.1"
                                         ) from None
    if not values or min(values) <= 0 or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive numbers, e.g. 1,0.1")
    return values


def str_list(text: str) -> list[str]:
    values = [part.strip() for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("give at least one name")
    return values


positive_int = whole_number(1)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: give a positive number")
    return value


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option]) -> None:
    for option in options:
        parser.add_argument(option.flag, type=option.type, default=None, metavar=option.metavar,
                            help=f"{option.help} (default {option.shown or _shown(option.full)}; "
                                 f"--smoke: {_shown(option.smoke)})".replace("%", "%%"))


def resolve(args: argparse.Namespace, options: Sequence[Option]) -> dict[str, Any]:
    """The settings: what the command line gave, else the mode's default."""
    settings = {}
    for option in options:
        given = getattr(args, option.dest, None)  # `all` has no per-benchmark options
        settings[option.dest] = (given if given is not None
                                 else option.smoke if args.smoke else option.full)
    return settings


# Statistics.

def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks; q in 0..100."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: Sequence[float]) -> float:
    """(max - min) / median: how far apart repetitions of the same thing landed."""
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle else 0.0


def median_interval(values: Sequence[float], confidence: float = 0.95,
                    resamples: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The median of paired differences (one per round) and its percentile bootstrap
    interval: (median, low, high). Seeded, so a results file can be reproduced."""
    if not values:
        raise ValueError("no values")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    tail = (1 - confidence) / 2 * 100
    return (statistics.median(values), percentile(medians, tail),
            percentile(medians, 100 - tail))


@dataclass(frozen=True)
class Fit:
    """y = intercept + slope * x, by least squares."""

    slope: float
    intercept: float
    r2: float

    def solve(self, y: float) -> float | None:
        """The x at which the line reaches y; None if it never does going up."""
        if self.slope <= 0:
            return None
        return (y - self.intercept) / self.slope


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("a line needs at least two points")
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a line needs two different x")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = mean_y - slope * mean_x
    total = sum((y - mean_y) ** 2 for y in ys)
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return Fit(slope, intercept, 1 - residual / total if total else 1.0)


# The machine.

def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _memory_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def machine() -> dict[str, Any]:
    return {
        "cores": CORES,
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": _version("torch"),
        "tensorflow": _version("tensorflow-cpu") or _version("tensorflow"),
        "prometheus_client": _version("prometheus-client"),
    }


STALE_MARK = "> **Older than the code it measures**"


def code_state(measures: Sequence[str]) -> dict[str, Any]:
    """The commit a benchmark ran on, the paths whose code it measures, and
    whether they had changes not committed (then the commit does not name it)."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=False)
        return done.stdout.strip() if done.returncode == 0 else ""
    return {"commit": git("rev-parse", "HEAD") or None, "measures": list(measures),
            "dirty": bool(git("status", "--porcelain", "--", *measures))}


def load_average() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return one, five, fifteen


class HostBusy:
    """Share of all the machine's cores busy between start() and stop(), from
    /proc/stat: the benchmark's own processes included, so it says how loaded
    the machine was, not by whom."""

    def __init__(self) -> None:
        self.shares: list[float] = []
        self._start: tuple[int, int] | None = None

    @staticmethod
    def _read() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> float:
        assert self._start is not None, "start() first"
        total, idle = self._read()
        elapsed = total - self._start[0]
        share = 1 - (idle - self._start[1]) / elapsed if elapsed else 0.0
        self.shares.append(share)
        self._start = None
        return share


# Processes of the benchmark: always stopped.

def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment with this checkout first on PYTHONPATH, so children import
    the dlprof_agent being measured."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra or {})
    return env


class Processes:
    """Every process a benchmark starts; whatever still runs at the end is
    stopped, first politely (its own ``stop_signal``), then with SIGKILL."""

    def __init__(self) -> None:
        self._started: dict[subprocess.Popen[str], int] = {}

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for process in reversed(list(self._started)):
            self.stop(process)

    def start(self, args: Sequence[str], *, stdin: int | IO[Any] | None = subprocess.DEVNULL,
              stdout: int | IO[Any] | None = subprocess.DEVNULL,
              env: dict[str, str] | None = None,
              stop_signal: int = signal.SIGTERM,
              code: Path | None = None) -> subprocess.Popen[str]:
        """Start ``args``; its stderr is kept aside, to explain a failure to start.
        ``code``: a folder holding another version's ``dlprof_agent``, run from
        there: ``-m`` puts the working folder first on the path, before this
        checkout (child_env), whose ``benchmarks`` it still finds."""
        log = tempfile.TemporaryFile()  # noqa: SIM115 - open until stop() closes it
        try:
            process = subprocess.Popen(list(args), stdin=stdin, stdout=stdout, stderr=log,
                                       text=True, cwd=code or REPO, env=env or child_env())
        except BaseException:
            log.close()
            raise
        self._started[process] = stop_signal
        _LOGS[process] = log
        return process

    def stop(self, process: subprocess.Popen[str], *, timeout: float = 10.0) -> int:
        how = self._started.pop(process, signal.SIGTERM)
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(how)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        for stream in (process.stdin, process.stdout, _LOGS.pop(process, None)):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        return process.returncode


_LOGS: dict[subprocess.Popen[str], IO[bytes]] = {}  # stderr of each running process


def stderr_tail(process: subprocess.Popen[str], lines: int = 5) -> str:
    log = _LOGS.get(process)
    if log is None:
        return ""
    log.seek(0)
    return " | ".join(log.read().decode(errors="replace").strip().splitlines()[-lines:])


def agent_command(*args: str) -> list[str]:
    """`dlprof-agent ARGS` from this checkout."""
    return [sys.executable, "-m", "dlprof_agent", *args]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def has_exited(process: subprocess.Popen[str]) -> bool:
    """Whether the child has ended, without taking a ptrace stop meant for an injector
    in this process: a tracee's stops go to whichever of the tracer's threads waits
    first, and Popen.poll() would reap one as an exit (returncode -133, SIGTRAP|0x80)."""
    if process.returncode is not None:
        return True
    try:
        state = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return process.poll() is not None
    if state is None or state.si_code not in (os.CLD_EXITED, os.CLD_KILLED, os.CLD_DUMPED):
        return False
    return process.poll() is not None


def wait_until(condition: Callable[[], Any], what: str, *, timeout: float = 30.0,
               alive: subprocess.Popen[str] | None = None) -> Any:
    """Poll until ``condition`` is truthy; an OSError counts as not yet."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):
            value = condition()
            if value:
                return value
        if alive is not None and has_exited(alive):
            raise RuntimeError(f"{what}: the process exited with {alive.returncode}: "
                               f"{stderr_tail(alive) or 'it said nothing'}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the process, all its threads (not its children)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no VmHWM for pid {pid}")


# HTTP: a client lean enough not to be the bottleneck of what it measures.

@dataclass(frozen=True)
class Scrape:
    seconds: float  # from connect to the last byte
    status: int
    body_bytes: int  # as sent: compressed when the server gzips
    body: bytes


def scrape(port: int, path: str = "/metrics", *, headers: str = PROMETHEUS_HEADERS,
           timeout: float = 10.0, keep_body: bool = False) -> Scrape:
    """One GET, by default with the headers Prometheus sends; the connection is
    then closed. A raw socket: urllib's own cost would blur small latencies."""
    request = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{headers}"
               "Connection: close\r\n\r\n").encode()
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    seconds = time.perf_counter() - started
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    return Scrape(seconds, status, len(body), body if keep_body else b"")


def get(port: int, path: str, *, timeout: float = 5.0) -> Scrape:
    """A plain GET (text format, no gzip), keeping the body."""
    return scrape(port, path, headers="", timeout=timeout, keep_body=True)


class Scraper:
    """Scrapes one endpoint from a thread: every ``period`` seconds on a fixed
    schedule (as Prometheus does), or back to back when ``period`` is 0."""

    def __init__(self, port: int, *, period: float, keep_last_body: bool = False) -> None:
        self.port = port
        self.period = period
        self.latencies: list[float] = []
        self.sizes: list[int] = []
        self.errors = 0
        self.last_body = b""
        self._keep = keep_last_body
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"scraper-{port}")

    def start(self) -> Scraper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        deadline = time.monotonic()
        while not self._stop.is_set():
            try:
                result = scrape(self.port, keep_body=self._keep)
            except OSError:
                self.errors += 1
            else:
                if result.status == 200:
                    self.latencies.append(result.seconds)
                    self.sizes.append(result.body_bytes)
                    if self._keep:
                        self.last_body = result.body
                else:
                    self.errors += 1
            if self.period:
                deadline += self.period
                now = time.monotonic()
                if deadline < now:  # overran: skip the missed ticks
                    deadline += math.ceil((now - deadline) / self.period) * self.period
                self._stop.wait(deadline - now)


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_value(exposition: bytes, name: str, **labels: str) -> float | None:
    """The value of the series ``name`` whose labels include ``labels``, in a
    text exposition; None when there is none."""
    for line in exposition.decode(errors="replace").splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        head, _, value = line.rpartition(" ")
        found = dict(_LABEL.findall(head[len(name):]))
        if all(found.get(key) == wanted for key, wanted in labels.items()):
            return float(value)
    return None


def metric_sum(exposition: bytes, name: str) -> float:
    """The sum of every series of ``name`` in a text exposition."""
    total = 0.0
    for line in exposition.decode(errors="replace").splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rpartition(" ")[2])
    return total


# Progress, on stderr so the result can go to stdout or a file.

class Progress:
    def __init__(self, name: str, total: int) -> None:
        self.name = name
        self.total = max(total, 1)
        self.done = 0
        self.started = time.monotonic()

    def advance(self, message: str) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.started
        left = elapsed / self.done * (self.total - self.done)
        print(f"[{self.name} {self.done}/{self.total}, {_duration(elapsed)} elapsed, "
              f"~{_duration(left)} left] {message}", file=sys.stderr, flush=True)

    def note(self, message: str) -> None:
        print(f"[{self.name}] {message}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 90 else f"{seconds / 60:.1f}min"


# Results.

@dataclass(frozen=True)
class Column:
    key: str
    title: str
    kind: str = "text"  # how Markdown shows the value; JSON keeps it raw (see _cell)


@dataclass
class Table:
    name: str
    title: str
    columns: list[Column]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TargetCheck:
    name: str
    target: str  # the requirement, in words
    measured: str  # the figure it was checked against, in words
    met: bool | None  # None: not measured in this run (the reason is in measured)


@dataclass
class Result:
    benchmark: str
    title: str
    what: str  # what is measured and how, a paragraph
    smoke: bool
    settings: dict[str, Any]
    tables: list[Table] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)  # the headline numbers
    targets: list[TargetCheck] = field(default_factory=list)
    noise: dict[str, Any] = field(default_factory=dict)
    noise_summary: str = ""
    resolution: str = ""  # the smallest difference the run can tell from none
    code: dict[str, Any] = field(default_factory=dict)  # code_state() when it ran
    unavailable: list[str] = field(default_factory=list)
    owed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self, command: str, started: datetime.datetime, seconds: float
                ) -> dict[str, Any]:
        return {
            "benchmark": self.benchmark, "title": self.title, "what": self.what,
            "smoke": self.smoke, "date": started.isoformat(timespec="seconds"),
            "duration_seconds": seconds, "command": command, "machine": machine(),
            "code": self.code, "resolution": self.resolution,
            "settings": self.settings, "noise": {**self.noise, "summary": self.noise_summary},
            "figures": self.figures, "targets": [asdict(t) for t in self.targets],
            "tables": [{"name": t.name, "title": t.title,
                        "columns": [asdict(c) for c in t.columns], "rows": t.rows,
                        "notes": t.notes} for t in self.tables],
            "unavailable": self.unavailable, "owed": self.owed, "notes": self.notes,
        }


def _cell(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if kind == "met":
        return "met" if value else "**missed**"
    if isinstance(value, bool):
        return "yes" if value else "no"
    number = float(value)
    formats: dict[str, Callable[[float], str]] = {
        "int": lambda v: f"{v:,.0f}",
        "s": lambda v: f"{v:.2f} s",
        "ms": lambda v: f"{v * 1e3:.2f} ms",
        "us": lambda v: f"{v * 1e6:.2f} µs",
        "ns": lambda v: f"{v * 1e9:.0f} ns",
        "pct": lambda v: f"{v * 100:.2f}%",
        "spct": lambda v: f"{v * 100:+.2f}%",
        "mib": lambda v: f"{v / 2**20:.1f} MiB",
        "kib": lambda v: f"{v / 2**10:.1f} KiB",
        "x": lambda v: f"{v:.1f}x",
        "rate": lambda v: f"{v:,.0f}/s",
        "float": lambda v: f"{v:.3g}",
    }
    shown = formats.get(kind)
    return shown(number) if shown is not None else f"{number:g}"


def render_markdown(result: Result, data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [f"# {result.title}", ""]
    if result.smoke:
        lines += ["> **Smoke run**: it checks that the harness works; its figures mean "
                  "nothing. Run without `--smoke` for the real ones.", ""]
    lines += [result.what, "",
              f"- **Date**: {data['date']} (took {_duration(data['duration_seconds'])})",
              f"- **Command**: `{data['command']}`",
              f"- **Machine**: {m['cores']} cores ({m['cpu_model']}), "
              + (f"{m['memory_bytes'] / 2**30:.0f} GiB, " if m["memory_bytes"] else "")
              + f"{m['kernel']}, Python {m['python']}, torch {m['torch'] or 'absent'}, "
              f"TensorFlow {m['tensorflow'] or 'absent'}",
              _code_line(data.get("code") or {}),
              f"- **Noise**: {result.noise_summary or 'not measured'}",
              "- **Resolution**: " + (result.resolution or "differences within the noise "
                                      "above are not resolved"),
              "- **Settings**: " + ", ".join(f"{k}={_shown(v)}"
                                             for k, v in result.settings.items()), ""]
    if result.targets:
        lines += ["## Targets", "", "| target | requirement | measured | verdict |",
                  "|---|---|---|---|"]
        for t in result.targets:
            verdict = "n/a" if t.met is None else "met" if t.met else "**missed**"
            lines.append(f"| {t.name} | {t.target} | {t.measured} | {verdict} |")
        lines.append("")
    for table in result.tables:
        lines += [f"## {table.title}", "",
                  "| " + " | ".join(c.title for c in table.columns) + " |",
                  "|" + "---|" * len(table.columns)]
        for row in table.rows:
            lines.append("| " + " | ".join(_cell(row.get(c.key), c.kind)
                                           for c in table.columns) + " |")
        lines.append("")
        lines += [f"{note}\n" for note in table.notes]
    for heading, items in (("Not measured in this run", result.unavailable),
                           ("Owed", result.owed), ("Notes", result.notes)):
        if items:
            lines += [f"## {heading}", "", *(f"- {item}" for item in items), ""]
    return "\n".join(lines).rstrip() + "\n"


def _code_line(code: dict[str, Any]) -> str:
    commit = code.get("commit")
    if not commit:
        return "- **Code**: not a git checkout"
    return (f"- **Code**: commit `{commit[:12]}`"
            + (" with uncommitted changes" if code.get("dirty") else "")
            + f", measuring {', '.join(code.get('measures', []))}")


def rerun_command(argv: Sequence[str], out: Path, default_out: Path) -> str:
    """The command that reruns this benchmark, without this machine's paths."""
    words: list[str] = []
    skip = False
    for index, word in enumerate(argv):
        if skip:
            skip = False
            continue
        if word == "--out" or word.startswith("--out="):
            skip = word == "--out" and index + 1 < len(argv)
            continue
        words.append(word)
    if out.resolve() != default_out.resolve():
        try:
            words += ["--out", str(out.resolve().relative_to(REPO))]
        except ValueError:
            words += ["--out", "DIR"]
    return " ".join(["python -m benchmarks.run", *words])


def write_result(result: Result, out: Path, command: str, started: datetime.datetime,
                 seconds: float) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    data = result.as_dict(command, started, seconds)
    json_path = out / f"{result.benchmark}.json"
    md_path = out / f"{result.benchmark}.md"
    # allow_nan=False: a NaN in a result is a bug in the harness, not a figure.
    json_path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    md_path.write_text(render_markdown(result, data))
    return md_path, json_path
