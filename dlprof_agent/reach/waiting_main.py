"""Whether a job's main thread waits in CPython's parking lot (``lock_wait``), read
from its /proc files without stopping it: on 3.14 such a thread takes PEP 768's
script only when its wait returns, so ``inject`` hands the probe to the ptrace
injector instead, which ends that wait with EINTR (and checks it again on the
stopped thread)."""

from __future__ import annotations

import contextlib

from dlprof_agent.collectors.target import Target
from dlprof_agent.reach.cpus import this_cpu
from dlprof_agent.reach.lock_wait import ParkingLotWait, waits_in_parking_lot
from dlprof_agent.reach.mapped_files import read_memory
from dlprof_agent.reach.procfs import memory_map
from dlprof_agent.reach.threads import thread_syscalls


def main_thread_parked(target: Target, wait: ParkingLotWait) -> bool:
    """The main thread of the target waits in the parking lot, described by ``wait``, for
    a caller that retries."""
    cpu = this_cpu()
    if cpu is None:
        return False
    main = next((fields for tid, fields in thread_syscalls(target) if tid == target.pid),
                None)
    if main is None or len(main) < 9:
        return False
    with contextlib.suppress(ValueError):
        stack_pointer = int(main[7], 16)
        stack = next((end for start, end, *_ in memory_map(target.pid, procfs=target.procfs)
                      if start <= stack_pointer < end), None)
        return stack is not None and waits_in_parking_lot(
            cpu, main, lambda address, size: read_memory(target, address, size), stack, wait)
    return False
