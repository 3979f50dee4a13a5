"""Who a target is in its job and its cluster: job id, rank, node rank, world size,
Kubernetes pod and container, read from its environment and its cgroup through
the one /proc reader.

The environment is the one the process started with (``/proc/<pid>/environ``):
launchers (torchrun, srun, Kubeflow's operators, TensorFlow's TF_CONFIG) put a
rank's place in the job there before it starts, so it is right for every rank of
every framework. Where the in-process probe is in, the probe's own reading
(``torch.distributed.get_rank()``) outranks it (``with_probe``): a job may set
its rank after exec.

Each label comes from the first source that is set (docs/fleet-identity.md has
the table). A value that is set but malformed (``RANK=abc``, a TF_CONFIG that is
no JSON, a Kubernetes cgroup path of a runtime this does not know) leaves that
label out and is named in ``Identity.problems``; the caller counts it once per
target. Nothing here raises for bad input.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from dlprof_agent.collectors.labels import cut_label
from dlprof_agent.collectors.procfs import ENVIRON_VALUE_MAX_CHARS, CgroupEntry, ProcessFiles

# Roles on dlprof_target_info.
ROLE_RANK = "rank"  # one process of a multi-process job
ROLE_LAUNCHER = "launcher"  # the parent of ranks that are targets (torchrun, srun)
ROLE_PROCESS = "process"  # anything else

# The first of each that is set gives the label (the TF_CONFIG task and hash are
# computed apart, at their place in the order: see identity_from_environment).
JOB_ID_VARIABLES = ("DLPROF_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
RANK_VARIABLES = ("RANK", "SLURM_PROCID")  # then the TF_CONFIG task, then JOB_COMPLETION_INDEX
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")
NODE_RANK_VARIABLES = ("GROUP_RANK", "SLURM_NODEID")
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "SLURM_NTASKS")  # then the TF_CONFIG task count
RESTART_VARIABLES = ("TORCHELASTIC_RESTART_COUNT",)
POD_VARIABLES = ("POD_NAME",)  # set from the downward API (metadata.name) by convention
NAMESPACE_VARIABLES = ("POD_NAMESPACE",)
# What makes a process a rank of its own for the daemon, even under a target.
RANK_MARKERS = ("RANK", "SLURM_PROCID", "TF_CONFIG")

# torchrun's --rdzv-id default: no job id at all.
_NO_RUN_ID = "none"
# TF_CONFIG's cluster roles that train, chief first: their tasks are the ranks.
_TF_TRAINING_ROLES = ("chief", "worker")
_MAX_RANK = 1 << 24  # larger than any job; a larger "rank" is not one
_JOB_HASH_CHARS = 12
# Label values keep printable characters; anything else becomes "_".
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


@dataclass(frozen=True, slots=True)
class Identity:
    """A target's place in its job and cluster; "" (None for the world size) where
    no source gives it."""

    job_id: str = ""
    rank: str = ""
    local_rank: str = ""
    node_rank: str = ""
    world_size: int | None = None
    restart_count: str = ""
    node: str = ""  # the node the agent runs on (--node-name)
    role: str = ROLE_PROCESS
    pod_uid: str = ""
    container_id: str = ""
    pod: str = ""
    namespace: str = ""
    problems: tuple[str, ...] = ()  # malformed or unreadable inputs, one phrase each


@dataclass(frozen=True, slots=True)
class Container:
    """What a cgroup path says of the container a process runs in."""

    pod_uid: str = ""  # with dashes, as the API server writes it
    container_id: str = ""  # the runtime's id, without the "containerd://" prefix
    runtime: str = ""  # "containerd", "cri-o", "docker" or "" where the path does not say


def label_value(text: str) -> str:
    """``text`` as a safe label value: printable ASCII, at most MAX_LABEL_CHARS (a
    longer one keeps its start and a short hash of the whole, so that two long
    values stay apart)."""
    return cut_label(_UNPRINTABLE.sub("_", text))


# --- cgroup paths ---------------------------------------------------------------------

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
# A static (mirror) pod's uid is the hash of its manifest: 32 hex digits, no dashes.
_STATIC_UID = r"[0-9a-f]{32}"
# cgroupfs driver: "pod<uid>"; systemd: "kubepods[-<qos>]-pod<uid with _>.slice".
_POD_SEGMENT = re.compile(rf"^(?:.*-)?pod(?P<uid>{_UID}|{_STATIC_UID})(?:\.slice)?$")
_POD_PREFIX = re.compile(r"(?:^|-)pod")
_ID = r"[0-9a-f]{64}"
# Container segments, each with the runtime it names. A bare id is the cgroupfs
# driver's (containerd and docker both write it so).
_CONTAINER_SEGMENTS = (
    (re.compile(rf"^cri-containerd-(?P<id>{_ID})\.scope$"), "containerd"),
    (re.compile(rf"^crio-(?P<id>{_ID})(?:\.scope)?$"), "cri-o"),
    (re.compile(rf"^docker-(?P<id>{_ID})\.scope$"), "docker"),
    (re.compile(rf"^(?P<id>{_ID})$"), ""),
)
# Outside Kubernetes: docker's own cgroups ("/docker/<id>", "system.slice/docker-<id>.scope").
_DOCKER_PARENT = "docker"


def _uid(text: str) -> str:
    return text.replace("_", "-")


def _container_segment(segment: str) -> tuple[str, str] | None:
    for pattern, runtime in _CONTAINER_SEGMENTS:
        found = pattern.match(segment)
        if found:
            return found["id"], runtime
    return None


def parse_cgroup_path(path: str) -> tuple[Container | None, str]:
    """The pod and container in one cgroup path (None for a path that names
    neither: a host process, "/" inside a cgroup namespace), and what was malformed
    ("" if nothing): a pod's container segment of a runtime this does not know
    (the pod uid is kept), or a kubepods path whose pod segment has no uid."""
    segments = [segment for segment in path.split("/") if segment]
    for index, segment in enumerate(segments):
        pod = _POD_SEGMENT.match(segment)
        if pod is None:
            continue
        found = Container(pod_uid=_uid(pod["uid"]))
        rest = segments[index + 1:]
        if not rest:
            return found, ""  # the pod's own cgroup
        container = _container_segment(rest[0])
        if container is None:
            return found, (f"the container in cgroup {label_value(path)!r} is of no "
                           "runtime known here")
        return Container(found.pod_uid, *container), ""
    if any(segment.startswith(("kubepods", "kubelet-kubepods")) for segment in segments):
        if any(_POD_PREFIX.search(segment) for segment in segments):
            return None, f"no pod uid in the Kubernetes cgroup {label_value(path)!r}"
        return None, ""  # the node's or a QoS class's own cgroup: no pod
    for index, segment in enumerate(segments):
        container = _container_segment(segment)
        if container is not None and (container[1] == "docker" or (
                index > 0 and segments[index - 1] == _DOCKER_PARENT)):
            return Container(container_id=container[0], runtime="docker"), ""
    return None, ""


def container_of(entries: Iterable[CgroupEntry]) -> tuple[Container | None, str]:
    """The container that a process's cgroup lines name, and what was malformed:
    the cgroup v2 line first, then the v1 hierarchies (a hybrid host's v2 line may
    name only systemd's view). A whole reading wins over a partial one."""
    best: Container | None = None
    problem = ""
    for entry in sorted(entries, key=lambda entry: entry.hierarchy != 0):
        found, malformed = parse_cgroup_path(entry.path)
        if found is not None and not malformed:
            return found, ""
        best = best or found
        problem = problem or malformed
    return best, problem


# --- the environment ------------------------------------------------------------------

class _Reader:
    """Reads labels from one environment, noting each malformed value."""

    def __init__(self, environment: Mapping[str, str]) -> None:
        self.environment = environment
        self.problems: list[str] = []

    def text(self, names: Iterable[str]) -> str:
        for name in names:
            value = self.environment.get(name, "").strip()
            if value:
                return label_value(value)
        return ""

    def any_set(self, names: Iterable[str]) -> bool:
        return any(self.environment.get(name, "").strip() for name in names)

    def number(self, names: Iterable[str]) -> str:
        """The first set variable as a whole number; a malformed one is noted and
        the next is not tried (it would tell another story)."""
        for name in names:
            value = self.environment.get(name, "").strip()
            if not value:
                continue
            if value.isdigit() and int(value) < _MAX_RANK:
                return str(int(value))
            self.problems.append(f"{name}={label_value(value[:32])!r} is no whole number")
            return ""
        return ""


@dataclass(frozen=True, slots=True)
class TfTask:
    """What TF_CONFIG says: the cluster's hash, the task's rank and the ranks."""

    job_hash: str
    rank: str  # "" for a task that does not train (ps, evaluator)
    world_size: int


def tf_config_task(text: str) -> TfTask:
    """Parse TF_CONFIG. Raises ValueError when it is not a cluster with a task."""
    if len(text) >= ENVIRON_VALUE_MAX_CHARS:
        raise ValueError(f"over {ENVIRON_VALUE_MAX_CHARS} characters (cut when read)")
    config = json.loads(text)
    if not isinstance(config, dict):
        raise ValueError("not a JSON object")
    cluster, task = config.get("cluster"), config.get("task")
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        raise ValueError("no cluster and task")
    members = [(role, index) for role in _TF_TRAINING_ROLES
               for index in range(len(_addresses(cluster, role)))]
    for role in cluster:
        _addresses(cluster, str(role))  # every role's tasks must be a list
    kind, index = task.get("type"), task.get("index", 0)
    if not isinstance(kind, str) or isinstance(index, bool) or not isinstance(index, int):
        raise ValueError("a task without type and index")
    canonical = json.dumps(cluster, sort_keys=True, separators=(",", ":"))
    job_hash = hashlib.sha256(canonical.encode()).hexdigest()[:_JOB_HASH_CHARS]
    rank = str(members.index((kind, index))) if (kind, index) in members else ""
    if kind in _TF_TRAINING_ROLES and not rank:
        raise ValueError(f"task {kind} {index} is not in the cluster")
    return TfTask(job_hash=f"tf-{job_hash}", rank=rank, world_size=len(members))


def _addresses(cluster: dict[object, object], role: str) -> list[object]:
    addresses = cluster.get(role, [])
    if not isinstance(addresses, list):
        raise ValueError(f"cluster role {role!r} is not a list")
    return addresses


def identity_from_environment(environment: Mapping[str, str]) -> Identity:
    """Every label the environment gives, with what was malformed in ``problems``."""
    read = _Reader(environment)
    tf_task: TfTask | None = None
    tf_text = environment.get("TF_CONFIG", "")
    if tf_text.strip():
        try:
            tf_task = tf_config_task(tf_text)
        except (ValueError, TypeError) as error:
            read.problems.append(f"TF_CONFIG: {label_value(str(error)[:80])}")
    job_id = read.text(name for name in JOB_ID_VARIABLES
                       if environment.get(name, "").strip().lower() != _NO_RUN_ID)
    if not job_id and tf_task is not None:
        job_id = tf_task.job_hash
    rank = read.number(RANK_VARIABLES)
    if not read.any_set(RANK_VARIABLES):  # a malformed RANK is not passed over
        if tf_task is not None:
            rank = tf_task.rank
        elif not tf_text.strip():
            rank = read.number(("JOB_COMPLETION_INDEX",))
    world = read.number(WORLD_SIZE_VARIABLES)
    world_size = int(world) if world else None
    if world_size is None and tf_task is not None and tf_task.world_size:
        world_size = tf_task.world_size
    return Identity(
        job_id=job_id, rank=rank, local_rank=read.number(LOCAL_RANK_VARIABLES),
        node_rank=read.number(NODE_RANK_VARIABLES), world_size=world_size,
        restart_count=read.number(RESTART_VARIABLES), pod=read.text(POD_VARIABLES),
        namespace=read.text(NAMESPACE_VARIABLES),
        role=ROLE_RANK if rank else ROLE_PROCESS, problems=tuple(read.problems))


def carries_rank(environment: Mapping[str, str] | None) -> bool:
    """Whether a launcher put this process's rank in its environment."""
    return environment is not None and any(
        environment.get(name, "").strip() for name in RANK_MARKERS)


# --- one target -----------------------------------------------------------------------

def read_identity(files: ProcessFiles, *, node: str = "") -> Identity:
    """A target's identity from its environment and cgroups. Raises TargetGone
    (from the reader) when the process has gone; unreadable files are problems."""
    environment = files.environ()
    problems: list[str] = []
    if environment is None:
        identity = Identity()
        problems.append("its environment may not be read")
    else:
        identity = identity_from_environment(environment)
    cgroups = files.cgroups()
    container = None
    if cgroups is None:
        problems.append("its cgroup file may not be read")
    else:
        container, malformed = container_of(cgroups)
        if malformed:
            problems.append(malformed)
    return replace(identity, node=label_value(node),
                   pod_uid=container.pod_uid if container else "",
                   container_id=container.container_id if container else "",
                   problems=(*identity.problems, *problems))


def with_probe(identity: Identity, settings: Iterable[tuple[str, Iterable[tuple[str, str]]]]
               ) -> Identity:
    """The probe's own rank and world size (its frameworks' "rank" and "world_size"
    settings, read from torch.distributed inside the job) in place of the
    environment's: the job may have chosen its rank after exec."""
    for _, values in settings:
        found = dict(values)
        rank, world = found.get("rank", ""), found.get("world_size", "")
        if rank.isdigit() and int(rank) < _MAX_RANK:
            world_size = (int(world) if world.isdigit() and int(world) < _MAX_RANK
                          else identity.world_size)
            return replace(identity, rank=str(int(rank)), world_size=world_size,
                           role=ROLE_RANK if identity.role == ROLE_PROCESS else identity.role)
    return identity


def info_labels(identity: Identity) -> dict[str, str]:
    """dlprof_target_info's labels besides pid, in the contract's order."""
    return {"job_id": identity.job_id, "rank": identity.rank,
            "local_rank": identity.local_rank, "node_rank": identity.node_rank,
            "world_size": "" if identity.world_size is None else str(identity.world_size),
            "restart_count": identity.restart_count, "node": identity.node,
            "role": identity.role, "pod_uid": identity.pod_uid,
            "container_id": identity.container_id, "pod": identity.pod,
            "namespace": identity.namespace}
