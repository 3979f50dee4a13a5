"""The benchmark suite: what the agent costs a training job, the machine and a
Prometheus scrape. Run ``python -m benchmarks.run --help``."""
