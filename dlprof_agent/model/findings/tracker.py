"""Findings pass after pass: a finding is raised once its cause has held for
RAISE_AFTER_SECONDS and cleared once it has been gone for CLEAR_AFTER_SECONDS, so
one odd sample neither raises nor clears one."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from dlprof_agent.model.findings.catalogue import KINDS, Finding, Kind
from dlprof_agent.model.findings.rules import RULES, Rule
from dlprof_agent.model.findings.window import MIN_WINDOW_SECONDS, WINDOW_SECONDS, Point, Window

# A cause must hold on every pass for this long before it is reported, and be
# gone for twice that before the finding clears: a single slow step, a garbage
# collection or a neighbour's burst must not make findings flicker.
RAISE_AFTER_SECONDS = 3.0
CLEAR_AFTER_SECONDS = 6.0


@dataclass
class _Hysteresis:
    holding_since: float | None = None
    gone_since: float | None = None
    raised_at: float | None = None

    def step(self, holds: bool, now: float) -> bool:
        """Whether the finding is raised after this pass."""
        if holds:
            self.gone_since = None
            if self.holding_since is None:
                self.holding_since = now
            if self.raised_at is None and now - self.holding_since >= RAISE_AFTER_SECONDS:
                self.raised_at = now
        else:
            self.holding_since = None
            if self.raised_at is not None:
                if self.gone_since is None:
                    self.gone_since = now
                if now - self.gone_since >= CLEAR_AFTER_SECONDS:
                    self.raised_at = self.gone_since = None
        return self.raised_at is not None


@dataclass
class FindingsTracker:
    """The findings of one target, pass after pass. Not thread-safe: the sampling
    loop owns it."""

    kinds: tuple[Kind, ...] = KINDS
    rules: Mapping[str, Rule] = field(default_factory=lambda: RULES)
    window_seconds: float = WINDOW_SECONDS
    _points: deque[Point] = field(default_factory=deque, init=False)
    _states: dict[str, _Hysteresis] = field(default_factory=dict, init=False)

    def update(self, point: Point) -> tuple[Finding, ...]:
        """Add one pass; return every rule that could judge it, raised or not."""
        points = self._points
        if points and point.pids.isdisjoint(points[-1].pids):
            points.clear()  # another process: its history is not this one's
        points.append(point)
        # Keep one point older than the window, so the window spans all of it.
        while len(points) > 2 and points[1].seconds <= point.seconds - self.window_seconds:
            points.popleft()
        if point.seconds - points[0].seconds < MIN_WINDOW_SECONDS:
            return ()
        window = Window(tuple(points))
        findings = []
        for kind in self.kinds:
            state = self._states.setdefault(kind.id, _Hysteresis())
            try:
                check = self.rules[kind.id](window)
            except (ArithmeticError, ValueError):
                check = None  # a figure the platform gave oddly: no judgement this pass
            if check is None:
                self._states[kind.id] = _Hysteresis()
                continue
            active = state.step(check.holds, point.seconds)
            findings.append(Finding(kind, active, tuple(sorted(check.evidence.items())),
                                    state.raised_at))
        return tuple(findings)
