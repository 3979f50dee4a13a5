"""Collectors read one source each (a process tree, the host, its limits, NVML) into
typed, immutable samples, through the one /proc reader (``procfs``); ``target`` is
the process a command is about, ``identity`` its place in its job, ``labels`` cuts
label values. They never import prometheus_client: only exporters render."""
