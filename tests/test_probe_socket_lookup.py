"""Where the agent looks for a job's probe socket: the job's own runtime dir,
also when the job runs in a container with its own pid namespace and /tmp."""

from __future__ import annotations

import os
from pathlib import Path

from dlprof_agent.probe_link.client import find_probe_socket


def fake_process(procfs: Path, pid: int, *, environ: dict[str, str], namespace_pid: int,
                 root: Path) -> None:
    directory = procfs / str(pid)
    directory.mkdir(parents=True)
    (directory / "environ").write_bytes(b"\0".join(f"{k}={v}".encode()
                                                   for k, v in environ.items()))
    (directory / "status").write_text(f"Name:\tpython\nNSpid:\t{pid}\t{namespace_pid}\n")
    (directory / "root").symlink_to(root)


def test_a_socket_in_the_jobs_runtime_dir_is_found(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir()
    (runtime / "probe-4242.sock").touch()
    fake_process(tmp_path / "proc", 4242, environ={"DLPROF_AGENT_RUNTIME_DIR": str(runtime)},
                 namespace_pid=4242, root=Path("/"))
    assert find_probe_socket(4242, procfs=str(tmp_path / "proc")) == str(
        runtime / "probe-4242.sock")


def test_a_containers_probe_is_found_under_its_own_pid_and_root(tmp_path: Path) -> None:
    container = tmp_path / "container"
    (container / "tmp" / "dlprof").mkdir(parents=True)
    (container / "tmp" / "dlprof" / "probe-7.sock").touch()
    fake_process(tmp_path / "proc", 4242, environ={"DLPROF_AGENT_RUNTIME_DIR": "/tmp/dlprof"},
                 namespace_pid=7, root=container)
    found = find_probe_socket(4242, procfs=str(tmp_path / "proc"))
    assert found == str(tmp_path / "proc" / "4242" / "root" / "tmp" / "dlprof" / "probe-7.sock")
    assert found is not None and os.path.exists(found)


def test_no_socket_is_none(tmp_path: Path) -> None:
    fake_process(tmp_path / "proc", 4242, environ={}, namespace_pid=4242, root=tmp_path)
    assert find_probe_socket(4242, procfs=str(tmp_path / "proc")) is None
