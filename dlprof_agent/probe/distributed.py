"""Whether the job takes part in a multi-process job (a torch.distributed process
group, a TensorFlow multi-worker cluster), read on the probe's thread as one more
framework setting, ``process_group``.

Time a rank spends in collectives (all-reduce, broadcast, barrier) falls outside
every phase the hooks see, exactly where time waiting for input falls; the
findings read this setting so that such a job gets no input verdict.

Nothing is imported: torch.distributed is read only once the job has imported
it completely, and TensorFlow's cluster only from its TF_CONFIG variable, which
every multi-worker strategy reads at its construction.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from dlprof_agent.probe.frameworks import imported

SETTING = "process_group"
NONE = "none"
# The roles of a TF_CONFIG cluster whose tasks exchange tensors with each other.
_TF_ROLES = ("chief", "worker", "ps")


def torch_process_group() -> str:
    """``backend:world_size`` of torch's default process group, else "none"."""
    if not imported(("torch", "torch.distributed")):
        return NONE
    dist: Any = sys.modules["torch.distributed"]
    if not dist.is_available() or not dist.is_initialized():
        return NONE
    return f"{dist.get_backend()}:{dist.get_world_size()}"


def tensorflow_cluster(environ: dict[str, str] | None = None) -> str:
    """``tf_config:<tasks>`` when TF_CONFIG names a cluster of several tasks."""
    text = (os.environ if environ is None else environ).get("TF_CONFIG", "")
    try:
        cluster = json.loads(text).get("cluster", {}) if text.strip() else {}
        tasks = sum(len(cluster.get(role, ())) for role in _TF_ROLES)
    except (ValueError, TypeError, AttributeError):
        return NONE
    return f"tf_config:{tasks}" if tasks > 1 else NONE


READERS = {"torch": torch_process_group, "tensorflow": tensorflow_cluster}


def process_group(framework: str) -> dict[str, str]:
    """The setting for ``framework``'s settings, or nothing for a framework
    without a reader; with the job's own rank and world size where it has them."""
    reader = READERS.get(framework)
    if reader is None:
        return {}
    return {SETTING: reader(), **RANK_READERS[framework]()}


# The rank as the job itself sees it, now: it outranks the environment the agent
# reads from /proc, which is the one at exec (a script may set TF_CONFIG, or call
# init_process_group with a rank of its choosing, after it started).
RANK = "rank"
WORLD_SIZE = "world_size"


def torch_rank() -> dict[str, str]:
    """torch.distributed's rank and world size once its process group is up."""
    if not imported(("torch", "torch.distributed")):
        return {}
    dist: Any = sys.modules["torch.distributed"]
    if not dist.is_available() or not dist.is_initialized():
        return {}
    return {RANK: str(dist.get_rank()), WORLD_SIZE: str(dist.get_world_size())}


def tensorflow_rank(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The TF_CONFIG task's rank among the training tasks, chief first (how
    MultiWorkerMirroredStrategy numbers them), from the job's environment now."""
    text = (os.environ if environ is None else environ).get("TF_CONFIG", "")
    try:
        config = json.loads(text) if text.strip() else {}
        cluster, task = config.get("cluster", {}), config.get("task", {})
        members = [(role, index) for role in ("chief", "worker")
                   for index in range(len(cluster.get(role, ())))]
        place = (task.get("type"), task.get("index", 0))
    except (ValueError, TypeError, AttributeError):
        return {}
    if place not in members:
        return {}
    return {RANK: str(members.index(place)), WORLD_SIZE: str(len(members))}


RANK_READERS = {"torch": torch_rank, "tensorflow": tensorflow_rank}
