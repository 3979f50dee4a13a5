"""The agent's own footprint while attached at a 1 s interval and scraped every second.

    python benchmarks/footprint.py [--seconds 60] [--threads 4] [--children 2]

Prints the agent's CPU seconds per minute (and as a share of one core), its peak
resident memory, the time one sampling pass takes and what a scrape costs.
Targets: at most 1% of a core and 60 MiB.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TARGET_CORE_SHARE = 0.01
TARGET_RSS_MIB = 60.0


def cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(url: str) -> tuple[float, bytes]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=5) as response:
        body = response.read()
    return time.perf_counter() - started, body


def sample_duration(exposition: bytes) -> float | None:
    for line in exposition.decode().splitlines():
        if line.startswith("dlprof_agent_sample_duration_seconds "):
            return float(line.split()[1])
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="measured time (default 60)")
    parser.add_argument("--warmup", type=float, default=5.0,
                        help="left out at the start: imports and the first samples (default 5)")
    parser.add_argument("--threads", type=int, default=4, help="busy threads in the target")
    parser.add_argument("--children", type=int, default=2, help="child processes of the target")
    args = parser.parse_args()

    target = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent.workloads.busy", "--threads", str(args.threads),
         "--children", str(args.children), "--duty", "0.5"],
        cwd=REPO, stdout=subprocess.PIPE)
    assert target.stdout is not None
    target.stdout.readline()
    port = free_port()
    agent = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "attach", str(target.pid), "--port", str(port),
         "--interval", "1", "--quiet", "--grace", "0"], cwd=REPO)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                scrape(url)
                break
            except OSError:
                if time.monotonic() > deadline or agent.poll() is not None:
                    raise SystemExit("the agent did not start") from None
                time.sleep(0.2)
        time.sleep(args.warmup)

        cpu_before, started = cpu_seconds(agent.pid), time.monotonic()
        latencies: list[float] = []
        passes: list[float] = []
        size = 0
        next_scrape = started
        while time.monotonic() - started < args.seconds:
            latency, body = scrape(url)
            latencies.append(latency)
            size = len(body)
            duration = sample_duration(body)
            if duration is not None:
                passes.append(duration)
            next_scrape += 1.0
            time.sleep(max(0.0, next_scrape - time.monotonic()))
        elapsed = time.monotonic() - started
        cpu_used = cpu_seconds(agent.pid) - cpu_before
        rss = peak_rss_mib(agent.pid)
    finally:
        agent.terminate()
        agent.wait(10)
        target.terminate()
        target.wait(10)

    core_share = cpu_used / elapsed
    latencies.sort()
    print(f"dlprof-agent footprint: {elapsed:.0f} s attached to a process tree of "
          f"{1 + args.children} processes, {args.threads} busy threads, "
          f"1 s interval, {len(latencies)} scrapes")
    print(f"  cpu           {60 * core_share:.3f} s per minute = {100 * core_share:.2f}% of "
          f"a core (target <= {100 * TARGET_CORE_SHARE:.0f}%): "
          + ("ok" if core_share <= TARGET_CORE_SHARE else "OVER"))
    print(f"  peak rss      {rss:.1f} MiB (target <= {TARGET_RSS_MIB:.0f} MiB): "
          + ("ok" if rss <= TARGET_RSS_MIB else "OVER"))
    if passes:
        print(f"  sample pass   median {1000 * statistics.median(passes):.2f} ms, "
              f"max {1000 * max(passes):.2f} ms")
    print(f"  scrape        median {1000 * statistics.median(latencies):.2f} ms, "
          f"p95 {1000 * latencies[int(0.95 * (len(latencies) - 1))]:.2f} ms, "
          f"{size / 1024:.1f} KiB exposition")
    return 0


if __name__ == "__main__":
    sys.exit(main())
