"""Blocked signals are per thread: /proc's status of each thread of a live process
holds that thread's own mask, and the process's status its main thread's."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from dlprof_agent.collectors.procfs import read_status

MAIN_BLOCKS = (signal.SIGUSR1,)
WORKER_BLOCKS = (signal.SIGUSR2, signal.SIGHUP)
# Each thread sets its mask whole, then says its thread id, the worker first; both
# stay until stdin closes.
JOB = textwrap.dedent(f"""
    import signal, sys, threading
    signal.pthread_sigmask(signal.SIG_SETMASK, {[int(s) for s in MAIN_BLOCKS]})
    said = threading.Event()

    def worker():
        signal.pthread_sigmask(signal.SIG_SETMASK, {[int(s) for s in WORKER_BLOCKS]})
        print(f"worker {{threading.get_native_id()}}", flush=True)
        said.set()
        threading.Event().wait()

    threading.Thread(target=worker, daemon=True).start()
    said.wait()
    print(f"main {{threading.get_native_id()}}", flush=True)
    sys.stdin.read()
""")


def mask(signals: tuple[signal.Signals, ...]) -> int:
    """The bit mask /proc shows: signal n is bit n - 1."""
    return sum(1 << (int(number) - 1) for number in signals)


def test_each_thread_reads_its_own_blocked_signals() -> None:
    job = subprocess.Popen([sys.executable, "-c", JOB], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    assert job.stdin is not None and job.stdout is not None
    try:
        tids = dict(job.stdout.readline().split() for _ in range(2))
        assert tids.keys() == {"main", "worker"} and int(tids["main"]) == job.pid
        main = read_status(job.pid, tid=int(tids["main"]))
        worker = read_status(job.pid, tid=int(tids["worker"]))
        process = read_status(job.pid)
        assert main is not None and worker is not None and process is not None
        assert main.sig_blk == mask(MAIN_BLOCKS)
        assert worker.sig_blk == mask(WORKER_BLOCKS)
        assert process.sig_blk == mask(MAIN_BLOCKS)
    finally:
        job.stdin.close()
        job.wait(10)
