"""The register state a borrowed thread must get back whole, and the check once it is
back (``ptrace``): the frame it returns through holds that state (``frame``); while
the agent lives it compares the state the kernel restored with the one it saved, and
puts any difference back with PTRACE_SETREGSET."""

from __future__ import annotations

import logging

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionUnsafe
from dlprof_agent.reach.frame import component_names, state_differences
from dlprof_agent.reach.tracer import Tracer
from dlprof_agent.reach.xsave_layout import LayoutUnknown, XsaveLayout, host_layout

log = logging.getLogger("dlprof_agent")


def cpu_layout(target: Target) -> XsaveLayout:
    try:
        return host_layout()
    except LayoutUnknown as error:
        raise unsafe(target, f"this CPU's XSAVE layout is unknown: {error}") from None


def unsafe(target: Target, why: str) -> InjectionUnsafe:
    return InjectionUnsafe(
        f"not injecting into process {target.pid}: a borrowed thread could not get its whole "
        f"register state back ({why})",
        "the agent reads the job from outside only; start the job with "
        "`dlprof-agent run -- python ...` for its probe", pid=target.pid)


def put_back(ptrace: Tracer, target: Target, tid: int, xstate: bytes | None,
             layout: XsaveLayout) -> None:
    """With ``tid`` stopped at the end of its detour's rt_sigreturn: any register
    state the kernel did not restore from the frame (``xstate``) goes back through
    ptrace."""
    if xstate is None:
        return
    restored = ptrace.xstate(tid)
    if restored is None or len(restored) != len(xstate):
        return
    lost = state_differences(xstate, restored, layout)
    if lost:
        ptrace.set_xstate(tid, xstate)
        log.warning("pid %d: thread %d came back from its detour without its %s "
                    "state; put back through ptrace", target.pid, tid, component_names(lost))
