"""Collectors read one source each (a process tree, the host, NVML) into typed,
immutable samples. They never import prometheus_client: only exporters render."""
