"""dlprof-agent: attach to a running training job and export where its time goes.

The data path reads from the folder names: ``probe`` runs inside the training
job and answers over its socket; ``collectors`` read the job (through /proc,
NVML and the probe's socket) into typed samples; ``model`` holds the snapshot
of one sampling pass and the findings' catalogue; ``agent`` samples on its own
clock, reaches the job, judges findings and runs the command line;
``exporters`` render snapshots for Prometheus; ``grafana`` holds the dashboards
that query Prometheus. ``errors`` is the one error hierarchy every floor uses.
"""

from __future__ import annotations

__version__ = "0.1.0"
