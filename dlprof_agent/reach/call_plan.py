"""Where, in a job, the functions the ptrace injector (``ptrace``) has a borrowed
thread call are, each checked to hold the bytes of that function in the job's own file
(``mapped_files``); and what the injector must know of the job's Python to borrow
safely: its lock waits (``lock_wait``), where a busy main thread may be stopped
(``safe_point``), 3.13's pending-call mutex (``pending_mutex``), and the words that say
its interpreter runs (``shutdown``)."""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import TargetGone
from dlprof_agent.reach.cpu import Cpu
from dlprof_agent.reach.cpus import this_cpu
from dlprof_agent.reach.elf import scan_elf_file
from dlprof_agent.reach.lock_wait import LockWait, ParkingLotWait, call_targets
from dlprof_agent.reach.mapped_files import (
    data_address,
    function_address,
    libc_path,
    mapped_file_paths,
    read_memory,
)
from dlprof_agent.reach.pending_mutex import pending_mutex_address
from dlprof_agent.reach.procfs import Mapping, executable, executable_path, memory_map
from dlprof_agent.reach.runtime import PythonRuntime
from dlprof_agent.reach.safe_point import BusyStops
from dlprof_agent.reach.shutdown import LifeWords, life_words

_MAX_CODE_BYTES = 64 << 20  # an executable mapping of libc larger than this is not searched
_INSTRUCTION_ALIGNMENT = {8: 4}  # arm64's two instructions start on a 4-byte boundary


class CallAddresses(NamedTuple):
    """Where, in the job, the functions the injector has a thread call are; each
    checked to hold the bytes of that function in its file."""

    add_pending_call: int  # Py_AddPendingCall
    run_simple_string: int  # PyRun_SimpleString
    mmap: int  # libc's
    sigreturn: int  # an rt_sigreturn of libc's signal restorer
    # [start, end) of PyThread_acquire_lock_timed, or 3.13's parking-lot wait: the main
    # thread's wait there is ended with EINTR (``lock_wait``); None where it cannot be
    # found and checked
    lock_wait: LockWait | None = None
    # Where a busy main thread may be stopped (``safe_point``); None: a busy thread is not
    # borrowed (3.13's pending-call mutex may release the caller's GIL; an unknown version)
    busy_stops: BusyStops | None = None
    # Where _PyRuntime says the interpreter runs (``shutdown``); None: not known here
    life: LifeWords | None = None


def plan_calls(target: Target, runtime: PythonRuntime) -> CallAddresses | None:
    """Addresses in the target of Py_AddPendingCall, PyRun_SimpleString, mmap and an
    rt_sigreturn; None when one cannot be found and checked (then gdb is used)."""
    cpu = this_cpu()
    maps = memory_map(target.pid, procfs=target.procfs)
    libc = libc_path(maps)
    if libc is None or cpu is None:
        return None
    try:
        exe = executable(target.pid, procfs=target.procfs)
    except TargetGone:
        return None
    if exe is None:
        return None
    # Every file through the job's root (``mapped_files``): a job in a chroot or a
    # container has its own libc, never the agent's.
    python_files = ([executable_path(target.pid, procfs=target.procfs)] if runtime.library == exe
                    else mapped_file_paths(target, runtime.library, maps))
    add = function_address(target, maps, runtime.library, python_files, "Py_AddPendingCall")
    run = function_address(target, maps, runtime.library, python_files, "PyRun_SimpleString")
    allocate = function_address(target, maps, libc, mapped_file_paths(target, libc, maps), "mmap")
    gadget = _find_sigreturn(target, maps, libc, cpu.sigreturn_code)
    if add is None or run is None or allocate is None or gadget is None:
        return None
    # Up to 3.12; 3.13 only where its pending-call mutex is found (``pending_mutex``)
    mutex = (_pending_mutex(target, maps, runtime.library, python_files, cpu)
             if runtime.version == (3, 13) else None)
    busy = (BusyStops(frozenset({runtime.library, exe}),
                      _function_extent(target, maps, runtime.library, python_files,
                                       "_PyEval_EvalFrameDefault"), mutex)
            if runtime.version is not None and (runtime.version < (3, 13) or mutex is not None)
            else None)
    lock_wait: LockWait | None = (
        _parking_lot_wait(target, maps, runtime.library, python_files, cpu)
        if runtime.version in PARKING_LOT_VERSIONS else
        _function_extent(target, maps, runtime.library, python_files,
                         "PyThread_acquire_lock_timed")
        if runtime.version is not None and runtime.version < (3, 13) else None)
    return CallAddresses(add, run, allocate, gadget, lock_wait, busy,
                         runtime_life(target, maps, runtime, python_files))


def runtime_life(target: Target, maps: list[Mapping], runtime: PythonRuntime, files: list[str]
                 ) -> LifeWords | None:
    """The words of the target's _PyRuntime that say its interpreter runs (``shutdown``);
    None where they cannot be placed."""
    runtime_state = data_address(target, maps, runtime.library, files, "_PyRuntime")
    return None if runtime_state is None else life_words(
        runtime.version, runtime_state, functools.partial(read_memory, target))


PARKING_LOT_VERSIONS = ((3, 13), (3, 14))  # whose lock waits were read (``lock_wait``)


def _pending_mutex(target: Target, maps: list[Mapping], path: str, files: list[str], cpu: Cpu
                   ) -> int | None:
    """3.13's main-thread pending-call mutex in the target (``pending_mutex``), or None."""
    runtime_state = data_address(target, maps, path, files, "_PyRuntime")
    adder = _function_extent(target, maps, path, files, "_PyEval_AddPendingCall")
    if runtime_state is None or adder is None:
        return None
    try:
        code = read_memory(target, adder[0], adder[1] - adder[0])
    except OSError:
        return None
    return pending_mutex_address(runtime_state, code, adder[0], cpu.names_address)


def _parking_lot_wait(target: Target, maps: list[Mapping], path: str, files: list[str],
                      cpu: Cpu) -> ParkingLotWait | None:
    semaphore_wait = _function_extent(target, maps, path, files, "_PySemaphore_Wait")
    park = _function_extent(target, maps, path, files, "_PyParkingLot_Park")
    event_wait = _function_extent(target, maps, path, files, "PyEvent_WaitTimed")
    if semaphore_wait is None or park is None:
        return None
    if cpu.name != "x86-64":
        # Park's copy without a symbol was read in x86-64's Debian 3.14 only (its
        # ``call rel32``s); elsewhere Park itself
        return ParkingLotWait(semaphore_wait, park)
    # The copy of Park that PyEvent_WaitTimed calls (3.14), where it is not Park itself
    at, code = event_wait[0] if event_wait else 0, b""
    with contextlib.suppress(OSError):
        code = read_memory(target, at, event_wait[1] - at) if event_wait else b""
    bound = 2 * (park[1] - park[0])
    return ParkingLotWait(semaphore_wait, park, tuple(
        (copy, copy + bound) for copy in sorted(set(call_targets(at, code)) - {park[0]})
        if any(start <= copy < end and "x" in rights for start, end, rights, *_ in maps)))


def _function_extent(target: Target, maps: list[Mapping], path: str, files: list[str],
                     name: str) -> tuple[int, int] | None:
    """[start, end) of function ``name`` in the target, checked as _function_address is."""
    start = function_address(target, maps, path, files, name)
    if start is None:
        return None
    for file in files:
        with contextlib.suppress(PermissionError):
            scan = scan_elf_file(file)
            if scan is not None:
                size = scan.size(name)
                return (start, start + size) if size else None
    return None


def _find_sigreturn(target: Target, maps: list[Mapping], libc: str, code: tuple[bytes, ...]
                    ) -> int | None:
    """An rt_sigreturn in libc's code (x86-64's signal restorer) or the vDSO's (arm64's
    ``__kernel_rt_sigreturn``, where glibc's handlers return)."""
    for start, end, permissions, _, path in maps:
        if path not in (libc, "[vdso]") or "x" not in permissions or (
                end - start > _MAX_CODE_BYTES):
            continue
        try:
            found = read_memory(target, start, end - start)
        except OSError:
            continue
        for gadget in code:
            at = found.find(gadget)
            if at >= 0 and at % _INSTRUCTION_ALIGNMENT.get(len(gadget), 1) == 0:
                return start + at
    return None
