"""The data model below the sampling loops and the exporters: snapshots and findings."""
