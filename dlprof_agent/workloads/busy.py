"""A synthetic busy process: named worker threads that really use several cores,
and optionally child processes, like a training job with loader workers.

    python -m dlprof_agent.workloads.busy --threads 4 --children 1 --seconds 30

Hashing a large buffer releases the GIL, so the threads run in parallel with
the standard library alone.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import functools
import hashlib
import multiprocessing
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_BUFFER = os.urandom(1 << 20)


@functools.cache
def _libc() -> ctypes.CDLL:
    # find_library runs ldconfig in a subprocess: once is enough.
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def set_thread_name(name: str) -> None:
    """Name the calling OS thread (what /proc/<pid>/task/<tid>/comm shows)."""
    if not sys.platform.startswith("linux"):
        return
    _libc().prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _hash_forever(name: str, stop: threading.Event, duty: float) -> None:
    set_thread_name(name)
    while not stop.is_set():
        started = time.monotonic()
        hashlib.sha256(_BUFFER).digest()
        if duty < 1.0:
            busy = time.monotonic() - started
            time.sleep(busy * (1 - duty) / duty)


def _child_main(seconds: float | None, duty: float) -> None:
    if sys.platform.startswith("linux"):
        # Die with the parent, however it ends: a leftover busy child skews every
        # measurement that follows.
        _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    stop = threading.Event()
    if seconds is not None:
        threading.Timer(seconds, stop.set).start()
    _hash_forever("busy-child", stop, duty)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlprof_agent.workloads.busy",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="worker threads (default 2)")
    parser.add_argument("--children", type=int, default=0,
                        help="child processes, one busy thread each (default 0)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="stop after this long (default: run until killed)")
    parser.add_argument("--duty", type=float, default=1.0,
                        help="share of time each worker computes, 0..1 (default 1)")
    parser.add_argument("--hold-mib", type=int, default=0,
                        help="hold this much memory resident, touched once (default 0)")
    args = parser.parse_args(argv)

    held = bytearray(args.hold_mib << 20)
    for page in range(0, len(held), 4096):
        held[page] = 1  # touch every page: resident, not just reserved
    stop = threading.Event()
    workers = [threading.Thread(target=_hash_forever, args=(f"busy-{i}", stop, args.duty),
                                daemon=True) for i in range(args.threads)]
    children = [multiprocessing.get_context("fork").Process(
        target=_child_main, args=(args.seconds, args.duty), daemon=True)
        for _ in range(args.children)]
    for worker in workers:
        worker.start()
    for child in children:
        child.start()
    print(f"busy: pid {os.getpid()}, {args.threads} threads, {args.children} children",
          flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait(args.seconds)
    stop.set()
    for child in children:
        child.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
