"""``python -m dlprof_agent`` is the same as the ``dlprof-agent`` command."""

from __future__ import annotations

import sys

from dlprof_agent.agent.cli import main

sys.exit(main())
