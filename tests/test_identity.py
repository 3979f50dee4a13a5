"""Who each target is: the cgroup parser, the precedence of the identity sources on
a captured /proc tree (tests/data/procfs_identity/, written by
``tests/capture_procfs.py --identity``), bad input, and the labels on the series.

The cgroup path shapes are the ones the kubelet and the runtimes write:
- the kubelet's pod cgroups, ``kubepods[/<qos>]/pod<uid>`` with the cgroupfs driver,
  and with the systemd driver the same names as slices, "-" turned into "_" inside
  each name (kubernetes/kubernetes pkg/kubelet/cm/cgroup_manager_linux.go,
  ``ConvertCgroupNameToSystemd``; the pod's name is ``"pod" + uid`` in
  pkg/kubelet/cm/pod_container_manager_linux.go); a static pod's uid is its
  manifest's hash, 32 hex digits;
- the container under the pod: containerd's CRI plugin names its systemd scope
  ``cri-containerd-<id>.scope``, CRI-O ``crio-<id>.scope`` (and ``crio-<id>`` with
  cgroupfs), docker ``docker-<id>.scope``; with the cgroupfs driver containerd and
  docker write the bare 64-digit id;
- docker outside Kubernetes: ``/docker/<id>`` (cgroupfs) and
  ``/system.slice/docker-<id>.scope`` (systemd), as neuvector/neuvector's
  share/system/cgroup_test.go captures them from Debian and CentOS hosts;
- kind and rootless nodes nest it all under ``kubelet.slice/kubelet-kubepods.slice``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from dlprof_agent.agent.snapshot_builder import SnapshotBuilder, TargetReaders, error_log
from dlprof_agent.collectors.host import HostCollector
from dlprof_agent.collectors.identity import (
    ROLE_LAUNCHER,
    ROLE_PROCESS,
    ROLE_RANK,
    Container,
    Identity,
    container_of,
    identity_from_environment,
    label_value,
    parse_cgroup_path,
    read_identity,
    tf_config_task,
    with_probe,
)
from dlprof_agent.collectors.labels import MAX_LABEL_CHARS
from dlprof_agent.collectors.process import ProcessSample
from dlprof_agent.collectors.procfs import CgroupEntry, ProcessFiles
from dlprof_agent.errors import TargetGone

TREE = Path(__file__).resolve().parent / "data" / "procfs_identity"
MANIFEST: dict[str, Any] = json.loads((TREE / "manifest.json").read_text())
ID = "3f1d2c4b" * 8
UID = "5e1c7a2e-9b0c-4d5e-8f6a-7b8c9d0e1f2a"
UID_ = UID.replace("-", "_")
STATIC_UID = "6d2cd8f6b4b8d7b9c3d0c4f3d5a5c9e1"


def pid_of(role: str) -> int:
    return int(MANIFEST["processes"][role]["pid"])


def captured(role: str, node: str = "node-a") -> Identity:
    return read_identity(ProcessFiles(pid_of(role), root=str(TREE)), node=node)


# --- the cgroup parser ------------------------------------------------------------------

@pytest.mark.parametrize(("path", "expected"), [
    # cgroupfs driver (v1 and v2 alike: the path is the same): containerd, docker, CRI-O
    (f"/kubepods/burstable/pod{UID}/{ID}", Container(UID, ID, "")),
    (f"/kubepods/besteffort/pod{UID}/{ID}", Container(UID, ID, "")),
    (f"/kubepods/pod{UID}/{ID}", Container(UID, ID, "")),  # guaranteed: no QoS level
    (f"/kubepods/burstable/pod{UID}/crio-{ID}", Container(UID, ID, "cri-o")),
    # systemd driver: containerd, CRI-O, docker (dockershim, cri-dockerd)
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
     f"cri-containerd-{ID}.scope", Container(UID, ID, "containerd")),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
     f"crio-{ID}.scope", Container(UID, ID, "cri-o")),
    (f"/kubepods.slice/kubepods-pod{UID_}.slice/docker-{ID}.scope",
     Container(UID, ID, "docker")),
    # kind / rootless: the kubelet's own slice above kubepods
    (f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
     f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{ID}.scope",
     Container(UID, ID, "containerd")),
    # a static (mirror) pod: its uid is a hash without dashes
    (f"/kubepods/burstable/pod{STATIC_UID}/{ID}", Container(STATIC_UID, ID, "")),
    # the pod's own cgroup (a process outside any container of it)
    (f"/kubepods.slice/kubepods-pod{UID_}.slice", Container(UID, "", "")),
    # docker outside Kubernetes, both drivers
    (f"/docker/{ID}", Container("", ID, "docker")),
    (f"/system.slice/docker-{ID}.scope", Container("", ID, "docker")),
    # nothing to say: a host process, a cgroup namespace's root, SLURM, a QoS level
    ("/user.slice/user-1000.slice/session-3.scope", None),
    ("/", None),
    ("/slurm/uid_1000/job_4711/step_0/task_1", None),
    ("/kubepods.slice/kubepods-burstable.slice", None),
    (f"/system.slice/containerd.service/{ID}", None),  # no runtime says it is a container
])
def test_cgroup_paths_of_each_runtime_and_driver(path: str,
                                                 expected: Container | None) -> None:
    assert parse_cgroup_path(path) == (expected, "")


@pytest.mark.parametrize(("path", "kept"), [
    # a runtime this parser does not know (Kata's shim): the pod uid is kept
    (f"/kubepods.slice/kubepods-pod{UID_}.slice/kata-{ID}.scope", Container(UID, "", "")),
    (f"/kubepods/burstable/pod{UID}/runsc-{ID}", Container(UID, "", "")),
    # a pod segment whose uid is not one
    ("/kubepods/burstable/podnot-a-uid/" + ID, None),
    ("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podXYZ.slice", None),
])
def test_a_cgroup_path_of_an_unknown_shape_is_named_and_left_out(
        path: str, kept: Container | None) -> None:
    found, problem = parse_cgroup_path(path)
    assert found == kept and problem


def test_the_v2_line_comes_first_and_a_hybrid_hosts_v1_lines_are_read_too() -> None:
    v1 = CgroupEntry(4, ("memory",), f"/kubepods/burstable/pod{UID}/{ID}")
    systemd_only = CgroupEntry(0, (), "/init.scope")
    assert container_of([systemd_only, v1]) == (Container(UID, ID, ""), "")
    v2 = CgroupEntry(0, (), f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-{ID}.scope")
    assert container_of([v1, v2]) == (Container(UID, ID, "cri-o"), "")
    unknown = CgroupEntry(0, (), f"/kubepods/pod{UID}/kata-{ID}")
    assert container_of([unknown]) == (Container(UID, "", ""), container_of([unknown])[1])
    assert container_of([unknown])[1]
    assert container_of([unknown, v1]) == (Container(UID, ID, ""), "")


# --- precedence, on the captured tree ---------------------------------------------------

def test_a_torchrun_rank_in_a_kubernetes_pod() -> None:
    assert captured("torchrun rank") == Identity(
        job_id="ddp-run-7", rank="5", local_rank="1", node_rank="2", world_size=8,
        restart_count="1", node="node-a", role=ROLE_RANK, pod_uid=UID, container_id=ID,
        pod="trainer-worker-1", namespace="ml")


def test_a_slurm_task() -> None:
    assert captured("slurm task") == Identity(
        job_id="4711", rank="3", local_rank="1", node_rank="1", world_size=4,
        node="node-a", role=ROLE_RANK)


def test_a_tf_config_worker_is_ranked_after_the_chief() -> None:
    identity = captured("tf worker")
    config = MANIFEST["processes"]["tf worker"]["environment"]["TF_CONFIG"]
    # chief, worker 0, worker 1: worker 1 is rank 2 of 3 (the ps trains nothing)
    assert (identity.rank, identity.world_size, identity.role) == ("2", 3, ROLE_RANK)
    assert identity.job_id == tf_config_task(config).job_hash
    assert identity.job_id.startswith("tf-") and len(identity.job_id) == 15
    assert (identity.pod_uid, identity.container_id) == (UID, ID)


def test_the_first_source_that_is_set_wins() -> None:
    identity = captured("explicit")
    # DLPROF_JOB_ID over SLURM_JOB_ID; RANK over SLURM_PROCID; docker outside Kubernetes
    assert (identity.job_id, identity.rank, identity.world_size) == ("nightly-bert", "0", 2)
    assert (identity.pod_uid, identity.container_id) == ("", ID)
    assert identity.problems == ()


def test_torchruns_default_run_id_is_no_job_id_and_an_indexed_job_gives_the_rank() -> None:
    identity = captured("indexed job")
    assert (identity.job_id, identity.rank, identity.role) == ("", "3", ROLE_RANK)
    assert (identity.pod_uid, identity.container_id) == (UID, ID)


def test_malformed_values_leave_their_labels_out_and_are_each_named() -> None:
    identity = captured("malformed")
    assert identity.job_id == "4713"  # the well-formed ones stay
    assert (identity.rank, identity.world_size, identity.container_id) == ("", None, "")
    assert identity.pod_uid == UID
    assert identity.role == ROLE_PROCESS
    problems = " | ".join(identity.problems)
    assert len(identity.problems) == 4, problems
    assert "RANK='abc'" in problems and "WORLD_SIZE='-1'" in problems
    assert "TF_CONFIG" in problems and "no runtime known" in problems


def test_an_unreadable_environment_leaves_the_environments_labels_out() -> None:
    identity = captured("unreadable")
    assert identity == Identity(node="node-a", problems=identity.problems)
    assert identity.problems == ("its environment may not be read",)


def test_a_process_that_has_gone_raises_target_gone(tmp_path: Path) -> None:
    with pytest.raises(TargetGone):
        read_identity(ProcessFiles(4_000_000, root=str(tmp_path)))


# --- bad input ---------------------------------------------------------------------------

def test_a_one_megabyte_tf_config_is_cut_when_read_and_refused(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    huge = json.dumps({"cluster": {"worker": ["w:1"] * 200_000},
                       "task": {"type": "worker", "index": 0}})
    assert len(huge) > 1 << 20
    (tmp_path / "42" / "environ").write_bytes(f"TF_CONFIG={huge}\0RANK=1\0".encode())
    (tmp_path / "42" / "cgroup").write_bytes(b"0::/\n")
    identity = read_identity(ProcessFiles(42, root=str(tmp_path)))
    assert identity.rank == "1" and identity.job_id == "" and identity.world_size is None
    assert len(identity.problems) == 1 and "TF_CONFIG" in identity.problems[0]
    assert len(identity.problems[0]) < 200


@pytest.mark.parametrize("config", [
    "[]", "{}", '{"cluster": []}', '{"cluster": {"worker": "a:1"}, "task": {}}',
    '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 5}}',
    '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": true}}',
])
def test_a_malformed_tf_config_is_named(config: str) -> None:
    identity = identity_from_environment({"TF_CONFIG": config, "JOB_COMPLETION_INDEX": "4"})
    assert identity.rank == "" and identity.job_id == ""  # not passed over to the next
    assert len(identity.problems) == 1


def test_a_tf_configs_job_id_is_the_same_for_every_task_and_order() -> None:
    cluster = {"worker": ["b:1", "c:1"], "chief": ["a:1"]}
    first = tf_config_task(json.dumps({"cluster": cluster, "task": {"type": "chief"}}))
    reordered = {"chief": ["a:1"], "worker": ["b:1", "c:1"]}
    second = tf_config_task(json.dumps({"task": {"type": "worker", "index": 0},
                                        "cluster": reordered}))
    assert first.job_hash == second.job_hash
    assert (first.rank, second.rank, first.world_size) == ("0", "1", 3)


def test_label_values_are_capped_and_printable() -> None:
    assert label_value("job-1") == "job-1"
    assert label_value('a"b\nc\x00d\u00e9') == 'a"b_c_d_'
    long = label_value("x" * 1000)
    assert len(long) == MAX_LABEL_CHARS and long != label_value("x" * 999)
    identity = identity_from_environment({"DLPROF_JOB_ID": "j" * 5000, "POD_NAME": "p\tq"})
    assert len(identity.job_id) == MAX_LABEL_CHARS and identity.pod == "p_q"


def test_the_probes_rank_outranks_the_environments() -> None:
    from_environment = identity_from_environment({"RANK": "3", "WORLD_SIZE": "4"})
    probe = (("torch", (("process_group", "gloo:8"), ("rank", "6"), ("world_size", "8"))),)
    assert with_probe(from_environment, probe) == Identity(rank="6", world_size=8,
                                                           role=ROLE_RANK)
    # A process the environment called nothing becomes a rank once its group is up.
    assert with_probe(Identity(), probe).role == ROLE_RANK
    # A probe without a process group, or with nonsense, changes nothing.
    assert with_probe(from_environment, (("torch", (("process_group", "none"),)),)
                      ) == from_environment
    assert with_probe(from_environment, (("torch", (("rank", "-1"),)),)) == from_environment


# --- through the snapshot builder --------------------------------------------------------

class _Tree:
    """A target's process reader that returns one sample (its root process)."""

    def __init__(self, pid: int, ppid: int) -> None:
        self.pid, self.ppid = pid, ppid

    def sample(self) -> tuple[ProcessSample, ...]:
        return (ProcessSample(pid=self.pid, ppid=self.ppid, name="python", is_target=True,
                              start_time_seconds=0.0, user_seconds=0.0, system_seconds=0.0,
                              iowait_seconds=0.0, rss_bytes=0, vms_bytes=0,
                              rss_peak_bytes=0, threads=1, thread_groups=(),
                              voluntary_context_switches=0, involuntary_context_switches=0,
                              read_bytes=None, write_bytes=None, read_chars=None,
                              write_chars=None, open_fds=None),)


def test_bad_input_is_counted_once_per_target_logged_once_and_stops_no_other(
        caplog: pytest.LogCaptureFixture) -> None:
    errors = error_log(gpu=False, probe=False)
    builder = SnapshotBuilder(host=HostCollector(), gpu=None, errors=errors,
                              node_name="gpu-node-3", procfs_root=str(TREE))
    good, bad, unreadable = pid_of("slurm task"), pid_of("malformed"), pid_of("unreadable")
    targets = [TargetReaders(pid, _Tree(pid, 1)) for pid in (bad, good, unreadable)]
    with caplog.at_level(logging.WARNING, logger="dlprof_agent"):
        for _ in range(3):
            node = builder.build(targets)
    assert dict(node.collector_errors)["identity"] == 2  # two targets, once each
    logged = [r.getMessage() for r in caplog.records if "identity collector" in r.getMessage()]
    assert len(logged) == 2 and all("Traceback" not in line for line in logged)
    assert f"pid {bad}:" in logged[0] and "RANK='abc'" in logged[0]
    identities = {s.target_pid: s.identity for s in node.targets}
    assert identities[good] == captured("slurm task", node="gpu-node-3")
    malformed = identities[bad]
    assert malformed is not None and malformed.job_id == "4713"
    assert all(identity is not None and identity.node == "gpu-node-3"
               for identity in identities.values())


def test_the_parent_of_a_rank_target_is_its_launcher() -> None:
    builder = SnapshotBuilder(host=HostCollector(), gpu=None,
                              errors=error_log(gpu=False, probe=False), procfs_root=str(TREE))
    rank, launcher = pid_of("torchrun rank"), pid_of("indexed job") + 10_000
    targets = [TargetReaders(launcher, _Tree(launcher, 1)),
               TargetReaders(rank, _Tree(rank, launcher))]
    node = builder.build(targets)
    roles = {s.target_pid: s.identity.role for s in node.targets if s.identity}
    # The launcher's own files are not in the tree: it reads as gone, with no labels.
    assert roles == {launcher: ROLE_LAUNCHER, rank: ROLE_RANK}
