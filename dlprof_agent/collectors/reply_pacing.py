"""How often an agent decodes a probe's snapshot reply: every pass, unless the
reply's rows are larger than a byte budget per pass.

Why: decoding a reply (checking its shape, then JSON, then its rows) costs the
agent in proportion to its size, about 45 ms for a 2.9 MB reply, every pass,
whatever the series budget keeps of it; a tenant decides that size. After a
reply of ``n`` times the budget, the next ``n - 1`` replies are received and
dropped undecoded, and the last sample stands for them, so decoding costs at
most about the budget's worth per pass per target, whatever a tenant sends.
Its figures are totals since the agent attached, so a rate over them loses
nothing; they are only older. The probe is still asked every pass, which keeps
its lease and its CUPTI tracer's tick as before. A ResNet-50 with --layers and
kernels sends about 60 KB: decoded every pass.
"""

from __future__ import annotations

import math
from dataclasses import replace

from dlprof_agent.collectors.probe_samples import ProbeSample

# Read at each use: tests shorten it. About a probe at its largest max_layers
# with short names; the 4,096-layer, 510-character tenant sends six times more.
REPLY_BYTES_PER_PASS = 512 * 1024


class ReplyPacing:
    """One probe connection's pace. Not thread-safe: its client owns it."""

    def __init__(self) -> None:
        self._last: ProbeSample | None = None
        self._passes_left = 0  # replies still to drop undecoded
        self.held_total = 0  # replies dropped undecoded so far

    def hold(self) -> ProbeSample | None:
        """The last sample, the same object, when this pass's reply is to be
        dropped undecoded (what is built from it can be reused: series_budget,
        exporters); None when it is to be decoded."""
        if self._last is None or self._passes_left <= 0:
            return None
        self._passes_left -= 1
        self.held_total += 1
        return self._last

    def decoded(self, sample: ProbeSample) -> ProbeSample:
        """``sample``, just decoded, kept to stand for the replies its size costs;
        with the replies dropped before it counted."""
        self._passes_left = math.ceil(sample.reply_row_bytes / REPLY_BYTES_PER_PASS) - 1
        self._last = replace(sample, replies_held=self.held_total)
        return self._last
