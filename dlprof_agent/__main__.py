"""``python -m dlprof_agent`` is the same as the ``dlprof-agent`` command."""

from __future__ import annotations

from dlprof_agent.cli.main import entry

entry()
