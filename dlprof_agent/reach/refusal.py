"""Why the kernel will not let the agent attach to a process, in one line, with what
would make it say yes there (a tracer already attached, a missing CAP_SYS_PTRACE, the
job's own capabilities, Yama's ptrace_scope)."""

from __future__ import annotations

import os

from dlprof_agent.collectors.target import Target, owner, user_name
from dlprof_agent.errors import InjectionRefused
from dlprof_agent.reach.procfs import comm, read_ptrace_scope, status_of

CAP_SYS_PTRACE = 19  # bit in /proc/<pid>/status CapEff


def refused(target: Target, what: str) -> InjectionRefused:
    """The one-line refusal, with what would make the kernel say yes here."""
    pid, procfs = target.pid, target.procfs
    status = status_of(pid, procfs=procfs)
    tracer = 0 if status is None else status.tracer_pid
    if tracer:
        return InjectionRefused(
            f"cannot attach to process {pid}: it is already traced by pid {tracer} "
            f"({comm(tracer, procfs=procfs)})",
            "only one tracer at a time: detach that debugger or profiler, then retry", pid=pid)
    own_status = status_of("self", procfs=procfs)
    own_caps = (own_status.cap_eff if own_status is not None else None) or 0
    has_ptrace = bool(own_caps >> CAP_SYS_PTRACE & 1)
    message = (f"not allowed to attach to process {pid} ({what}; it is owned by "
               f"{owner(pid, procfs)}, the agent runs as {user_name(os.getuid())} "
               f"{'with' if has_ptrace else 'without'} CAP_SYS_PTRACE)")
    if not has_ptrace:
        hint = ("run the agent as the job's user or give it CAP_SYS_PTRACE (root without it is "
                "not enough; in a container: --cap-add SYS_PTRACE)")
    elif ((status.cap_prm if status is not None else None) or 0) & ~own_caps:
        # The kernel also wants the tracer to hold every capability the tracee holds.
        hint = ("the job holds capabilities the agent lacks: run the agent with at least the "
                "job's privileges (in a container: the same --cap-add/--privileged)")
    else:
        hint = ("the job may run in a parent user namespace, or a security module (AppArmor, "
                "SELinux) forbids ptrace: run the agent inside the job's container")
    scope = read_ptrace_scope(procfs=procfs) or ""
    if scope == "1":
        hint += ("; kernel.yama.ptrace_scope is 1: only a parent process may attach unless "
                 "the agent has CAP_SYS_PTRACE, so the same user is not enough")
    elif scope == "2":
        hint += "; kernel.yama.ptrace_scope is 2: only a process with CAP_SYS_PTRACE may attach"
    elif scope == "3":
        hint = ("kernel.yama.ptrace_scope is 3: attaching is disabled until reboot, so the "
                "probe cannot be injected on this host; start the job with `dlprof-agent run`")
    elif scope:
        hint += f"; kernel.yama.ptrace_scope is {scope}"
    return InjectionRefused(message, hint, pid=pid)
