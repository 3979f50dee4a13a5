"""dlprof-agent: attach to a running training job and export where its time goes.

The data path reads from the folder names: the target process is read by
``collectors`` into typed samples, ``agent`` samples them on its own clock and
serves them, ``exporters`` render them for Prometheus, and ``grafana`` holds the
dashboards that query Prometheus.
"""

from __future__ import annotations

__version__ = "0.1.0"
