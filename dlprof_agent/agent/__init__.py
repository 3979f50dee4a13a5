"""The agent: the sampling loops, serving /metrics, and the live status."""
