"""``python -m dlprof_agent`` is the same as the ``dlprof-agent`` command."""

from __future__ import annotations

import sys

from dlprof_agent.cli.main import main

sys.exit(main())
