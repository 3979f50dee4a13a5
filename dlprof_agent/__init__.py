"""dlprof-agent: attach to a running training job and export where its time goes.

The folders, in data-path order: ``probe`` runs inside the training job and
answers over its socket; ``collectors`` read the job and its host (/proc,
cgroups, NVML) into typed samples; ``reach`` injects the probe into a running
job; ``probe_link`` is the agent's end of the probe's socket, decoding its
replies into samples; ``model`` holds a sampling pass's snapshot and the
findings' rules; ``exporters`` render snapshots and recording rules for
Prometheus; ``grafana`` holds the dashboards that query it; ``workloads`` are
reference training jobs to measure; ``agent`` samples on its own clock and
serves /metrics; ``cli`` holds the commands. ``errors`` is the one error
hierarchy every folder uses.
"""

from __future__ import annotations

__version__ = "0.1.0"
