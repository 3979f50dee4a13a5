"""How often an agent decodes a probe's snapshot reply: every pass, unless the
reply's rows are larger than a byte budget per pass.

Why: decoding a reply costs the agent in proportion to its size, whatever the
series budget keeps of it, and a tenant decides that size: a reply of 4,096
layers with 510-character names and 4,000 kernels (2.9 MB) costs about 26 ms
to check, parse and cut to the budget (reply_rows), every pass. After a reply
of ``n`` times the budget, the last sample stands for the next ``n - 1``
passes, so decoding costs about the budget's worth per pass per target at
most. Its figures are totals since the agent attached, so a rate over them
loses nothing; they are only older. During those passes the probe is asked
every other pass and its reply taken off the socket undecoded (about 1 ms):
that keeps its lease (three intervals and a second of silence) and its
tracer's tick, and spares the job writing a reply no one decodes every pass.
A ResNet-50 with --layers and kernels sends about 40 KB of rows: decoded every
pass, as before.
"""

from __future__ import annotations

import math
from dataclasses import replace

from dlprof_agent.probe_link.samples import ProbeSample

# Read at each use: tests change them. Three times a ResNet-50's rows; the
# 4,096-layer, 510-character tenant sends 24 times more.
REPLY_BYTES_PER_PASS = 128 * 1024
# A probe whose replies are held is asked at least every this many passes: well
# within its lease (probe/session.py), three intervals and a second.
ASK_EVERY_PASSES = 2


class ReplyPacing:
    """One probe connection's pace. Not thread-safe: its client owns it."""

    def __init__(self) -> None:
        self._last: ProbeSample | None = None
        self._passes_left = 0  # passes the last sample still stands for
        self._unasked = 0  # passes since the probe was last asked
        self.held_total = 0  # passes the last sample stood for, so far

    def hold(self) -> tuple[ProbeSample, bool] | None:
        """The last sample, the same object (what is built from it can be
        reused: series_budget, exporters), when this pass decodes nothing; and
        whether to ask the probe all the same, dropping its reply undecoded.
        None when this pass decodes a reply."""
        if self._last is None or self._passes_left <= 0:
            return None
        self._passes_left -= 1
        self.held_total += 1
        self._unasked += 1
        ask = self._unasked >= ASK_EVERY_PASSES
        if ask:
            self._unasked = 0
        return self._last, ask

    def decoded(self, sample: ProbeSample) -> ProbeSample:
        """``sample``, just decoded, kept to stand for the replies its size costs;
        with the replies dropped before it counted."""
        self._passes_left = math.ceil(sample.reply_row_bytes / REPLY_BYTES_PER_PASS) - 1
        self._unasked = 0
        self._last = replace(sample, replies_held=self.held_total)
        return self._last
