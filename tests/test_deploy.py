"""The deployment files under deploy/: the manifests hold what the agent needs
(the host's pids, SYS_PTRACE, NVML without a GPU, health probes on the metrics
port), their pieces agree with each other and with the agent's own command
line, the systemd unit verifies, and the SLURM prolog and epilog really start
and stop an agent (a stand-in) and its Prometheus target file."""

from __future__ import annotations

import argparse
import configparser
import contextlib
import fnmatch
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dlprof_agent.cli import main as cli
from dlprof_agent.cli.options import NODE_NAME_VARIABLES
from dlprof_agent.collectors.identity import NAMESPACE_VARIABLES, POD_VARIABLES
from dlprof_agent.exporters.families import JOB_LABELS, TARGET_INFO_LABELS
from tests.conftest import agent_env, http_get, wait_for

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
COMPOSE = DEPLOY / "docker-compose.yml"
UNIT = DEPLOY / "systemd" / "dlprof-agent.service"
PROLOG = DEPLOY / "slurm" / "prolog.sh"
EPILOG = DEPLOY / "slurm" / "epilog.sh"
TASK_PROLOG = DEPLOY / "slurm" / "task-prolog.sh"
SHELL_SCRIPTS = (PROLOG, EPILOG)  # the job's agent's, which share their conventions
LINTED_SCRIPTS = (*SHELL_SCRIPTS, TASK_PROLOG)
BASH = shutil.which("bash") or "/bin/bash"
PORT = 9945
# What the SLURM scripts call; they do without setsid and hostname, and logger
# is left out so that the tests write nothing to the system log.
SCRIPT_TOOLS = ("mkdir", "cat", "tr", "grep", "sleep", "tail", "rm", "chmod", "mv", "sed",
                "hostname", "setsid")


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def load(path: Path) -> dict[str, Any]:
    (doc,) = load_all(path)
    return doc


def kubernetes_objects() -> dict[str, dict[str, Any]]:
    """The kustomization's resources by kind."""
    objects: dict[str, dict[str, Any]] = {}
    for name in load(KUBERNETES / "kustomization.yaml")["resources"]:
        for doc in load_all(KUBERNETES / name):
            assert doc["kind"] not in objects, f"two {doc['kind']}s"
            objects[doc["kind"]] = doc
    return objects


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict[str, Any]]:
    return kubernetes_objects()


def pod_spec(k8s: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = k8s["DaemonSet"]["spec"]["template"]["spec"]
    return spec


def agent_container(k8s: dict[str, dict[str, Any]]) -> dict[str, Any]:
    agents: list[dict[str, Any]] = [c for c in pod_spec(k8s)["containers"]
                                    if c["name"] == "agent"]
    (agent,) = agents
    return agent


def daemon_parser() -> argparse.ArgumentParser:
    """The agent's own parser: every command line shipped here must parse."""
    return cli.build_parser()


def assert_agent_accepts(argv: list[str]) -> argparse.Namespace:
    """``argv`` (after the program name) is a daemon command line the agent takes."""
    assert argv[0] == "daemon", argv
    try:
        return daemon_parser().parse_args(argv)
    except SystemExit as error:
        raise AssertionError(f"dlprof-agent rejects {shlex.join(argv)}") from error


# Every YAML file parses.

@pytest.mark.parametrize("path", sorted([*KUBERNETES.rglob("*.yaml"), COMPOSE]),
                         ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    docs = load_all(path)
    assert docs and all(isinstance(doc, dict) for doc in docs)


# Kubernetes.

def test_kustomization_lists_every_manifest(k8s: dict[str, dict[str, Any]]) -> None:
    listed = set(load(KUBERNETES / "kustomization.yaml")["resources"])
    on_disk = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert set(k8s) == {"Namespace", "DaemonSet", "Service", "ServiceMonitor"}
    assert k8s["ServiceMonitor"]["apiVersion"] == "monitoring.coreos.com/v1"


def test_daemonset_sees_the_hosts_processes(k8s: dict[str, dict[str, Any]]) -> None:
    spec = pod_spec(k8s)
    assert spec["hostPID"] is True
    # The Service scrapes the pod IP; the host's network is not needed.
    assert not spec.get("hostNetwork", False)


def test_daemonset_runs_the_daemon_on_the_metrics_port(k8s: dict[str, dict[str, Any]]) -> None:
    agent = agent_container(k8s)
    command = [*agent.get("command", []), *agent.get("args", [])]
    assert command[:2] == ["dlprof-agent", "daemon"]
    assert command[command.index("--listen") + 1] == "0.0.0.0"
    (port,) = agent["ports"]
    assert port == {"name": "metrics", "containerPort": PORT, "protocol": "TCP"}
    assert int(command[command.index("--port") + 1]) == port["containerPort"]


def test_daemonset_command_is_one_the_agent_takes(k8s: dict[str, dict[str, Any]]) -> None:
    agent = agent_container(k8s)
    options = assert_agent_accepts(agent["command"][1:])
    assert (options.listen, options.port) == ("0.0.0.0", PORT)


def test_daemonset_may_ptrace_and_keeps_nothing_else(k8s: dict[str, dict[str, Any]]) -> None:
    context = agent_container(k8s)["securityContext"]
    assert "SYS_PTRACE" in context["capabilities"]["add"]
    assert context["capabilities"]["drop"] == ["ALL"]
    assert set(context["capabilities"]["add"]) <= {"SYS_PTRACE", "DAC_OVERRIDE", "KILL"}
    assert context["privileged"] is False
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["runAsUser"] == 0
    # The runtime's default AppArmor profile would forbid ptrace to other pods.
    assert context["appArmorProfile"] == {"type": "Unconfined"}


def test_daemonset_reads_gpus_without_taking_one(k8s: dict[str, dict[str, Any]]) -> None:
    spec = pod_spec(k8s)
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        resources = container.get("resources", {})
        for kind in ("requests", "limits"):
            assert not any(name.startswith("nvidia.com/")
                           for name in resources.get(kind, {})), container["name"]
    env = {e["name"]: e.get("value") for e in agent_container(k8s)["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert spec["runtimeClassName"] == "nvidia"
    assert any(t.get("key") == "nvidia.com/gpu" for t in spec["tolerations"])
    assert spec["nodeSelector"]


def test_daemonset_is_small(k8s: dict[str, dict[str, Any]]) -> None:
    resources = agent_container(k8s)["resources"]
    assert resources["requests"] == {"cpu": "50m", "memory": "64Mi"}
    assert set(resources["limits"]) == {"cpu", "memory"}


def test_health_probes_hit_healthz_on_the_metrics_port(k8s: dict[str, dict[str, Any]]) -> None:
    agent = agent_container(k8s)
    port_names = {p["name"] for p in agent["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        get = agent[probe]["httpGet"]
        assert get["path"] == "/healthz"
        assert get["port"] in port_names | {PORT}, probe


def test_service_and_servicemonitor_select_the_agent(k8s: dict[str, dict[str, Any]]) -> None:
    daemonset, service, monitor = k8s["DaemonSet"], k8s["Service"], k8s["ServiceMonitor"]
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["clusterIP"] == "None"  # every pod scraped on its own
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["name"] == "metrics"
    assert service_port["targetPort"] == agent_container(k8s)["ports"][0]["name"]
    assert monitor["spec"]["selector"]["matchLabels"].items() \
        <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"]
    assert endpoint.get("path", "/metrics") == "/metrics"


def test_the_daemonset_names_its_node_as_kubernetes_does(k8s: dict[str, dict[str, Any]]
                                                         ) -> None:
    """NODE_NAME, the daemon's --node-name default, from the downward API: the
    node label of dlprof_target_info is the one kube-state-metrics uses."""
    env = {e["name"]: e for e in agent_container(k8s)["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert NODE_NAME_VARIABLES[0] == "NODE_NAME"
    options = assert_agent_accepts(agent_container(k8s)["command"][1:])
    assert options.node_name is None  # so the environment's is taken


def test_the_servicemonitor_keeps_the_job_and_rank_labels(k8s: dict[str, dict[str, Any]]
                                                          ) -> None:
    (endpoint,) = k8s["ServiceMonitor"]["spec"]["endpoints"]
    # dlprof_target_info's pod, namespace and node win over the Operator's target
    # labels, which name the agent's pod.
    assert endpoint["honorLabels"] is True
    for relabeling in [*endpoint.get("relabelings", []),
                       *endpoint.get("metricRelabelings", [])]:
        action = relabeling.get("action", "replace")
        target = relabeling.get("targetLabel")
        if target == "node":  # the same name as dlprof_target_info's: spec.nodeName's
            assert relabeling["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
        else:
            assert target not in (*JOB_LABELS, *TARGET_INFO_LABELS)
        if action in ("labeldrop", "labelkeep"):
            pattern = re.compile(relabeling["regex"])
            kept = [label for label in JOB_LABELS
                    if bool(pattern.fullmatch(label)) == (action == "labelkeep")]
            assert kept == list(JOB_LABELS), relabeling
        if action in ("drop", "keep"):
            assert not set(relabeling.get("sourceLabels", ())) & set(JOB_LABELS)


def test_the_training_pod_example_names_its_pod_for_the_agent() -> None:
    job = load(KUBERNETES / "examples" / "training-job.yaml")["spec"]["template"]["spec"]
    (train,) = job["containers"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
           for e in train["env"]}
    assert env[POD_VARIABLES[0]] == "metadata.name"
    assert env[NAMESPACE_VARIABLES[0]] == "metadata.namespace"


def test_training_pods_share_the_agents_runtime_dir(k8s: dict[str, dict[str, Any]]) -> None:
    """A probe's socket is looked up at the path the job's environment names, so
    the job and the agent mount the host directory at the same path."""
    def mounts(container: dict[str, Any], volumes: list[dict[str, Any]]) -> dict[str, str]:
        host = {v["name"]: v["hostPath"]["path"] for v in volumes if "hostPath" in v}
        return {m["mountPath"]: host[m["name"]] for m in container["volumeMounts"]
                if m["name"] in host}

    spec = pod_spec(k8s)
    agent_mounts = mounts(agent_container(k8s), spec["volumes"])
    job = load(KUBERNETES / "examples" / "training-job.yaml")["spec"]["template"]["spec"]
    (train,) = job["containers"]
    job_mounts = mounts(train, job["volumes"])
    env = {e["name"]: e.get("value") for e in train["env"]}
    runtime_dir = env["DLPROF_AGENT_RUNTIME_DIR"]
    (shared,) = [path for path in job_mounts if runtime_dir.startswith(path + "/")]
    assert agent_mounts[shared] == job_mounts[shared]
    # The job's own subdirectory; $(POD_UID) must be defined before it is used.
    assert runtime_dir == f"{shared}/$(POD_UID)"
    assert [e["name"] for e in train["env"]].index("POD_UID") \
        < [e["name"] for e in train["env"]].index("DLPROF_AGENT_RUNTIME_DIR")
    # The daemon finds the sockets by its own DLPROF_AGENT_RUNTIME_DIR, a pattern.
    agent_env = {e["name"]: e.get("value") for e in agent_container(k8s)["env"]}
    pod_dir = runtime_dir.replace("$(POD_UID)", "0b6a1f0e-5c1d-4b7a-9d7e-2f1c3a4b5c6d")
    assert fnmatch.fnmatchcase(pod_dir, agent_env["DLPROF_AGENT_RUNTIME_DIR"])
    # Non-root probes create their directory in it: the init container opens it up.
    (init,) = spec["initContainers"]
    assert f"chmod 1777 {shared}" in " ".join(init["command"])


def test_image_placeholder_is_the_same_everywhere(k8s: dict[str, dict[str, Any]]) -> None:
    spec = pod_spec(k8s)
    images = {c["image"] for c in [*spec["initContainers"], *spec["containers"]]}
    assert images == {load(COMPOSE)["services"]["agent"]["image"]}
    (image,) = load(KUBERNETES / "kustomization.yaml")["images"]
    assert images == {f"{image['name']}:{image['newTag']}"}


def test_the_training_example_starts_its_probe_at_launch_from_the_init_containers_copy(
        ) -> None:
    job = load(KUBERNETES / "examples" / "training-job.yaml")["spec"]["template"]["spec"]
    (train,) = job["containers"]
    (copier,) = job["initContainers"]
    env = {e["name"]: e.get("value") for e in train["env"]}
    assert env["DLPROF_PROBE"] == "1"
    (copied_to,) = [a for a in copier["command"] if a.startswith("/")]
    assert copier["command"][:2] == ["dlprof-agent", "probe-copy"]
    cli.build_parser().parse_args(copier["command"][1:])
    volume = {m["mountPath"]: m["name"] for m in copier["volumeMounts"]}[copied_to]
    assert {m["name"]: m["mountPath"] for m in train["volumeMounts"]}[volume] == copied_to
    assert env["PYTHONPATH"] == copied_to


def test_the_no_ptrace_component_never_injects_and_keeps_no_ptrace(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    kustomization = load(copy / "kustomization.yaml")
    kustomization["components"] = ["no-ptrace"]
    (copy / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    result = subprocess.run([kubectl, "kustomize", str(copy)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    (daemonset,) = [doc for doc in yaml.safe_load_all(result.stdout)
                    if doc and doc["kind"] == "DaemonSet"]
    (agent,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"]
                if c["name"] == "agent"]
    assert "--no-inject" in agent["command"]
    assert not assert_agent_accepts(agent["command"][1:]).inject
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"],
                                                        "add": ["DAC_OVERRIDE"]}


def test_the_compose_example_job_starts_its_probe_at_launch(compose: dict[str, Any]) -> None:
    assert compose["services"]["train"]["environment"]["DLPROF_PROBE"] == "1"


@pytest.mark.parametrize(("environment", "exported"), [
    ({}, ["export DLPROF_PROBE=1"]),
    ({"DLPROF_PROBE": "0"}, []),
    ({"DLPROF_PROBE_PATH": "/", "PYTHONPATH": "/job"},
     ["export DLPROF_PROBE=1", "export PYTHONPATH=/:/job"]),
])
def test_the_task_prolog_exports_the_variable_unless_the_job_set_it(
        environment: dict[str, str], exported: list[str]) -> None:
    env = {"PATH": os.environ["PATH"], **environment}
    result = subprocess.run([BASH, str(TASK_PROLOG)], env=env, capture_output=True,
                            text=True, timeout=30, check=True)
    assert result.stdout.splitlines() == exported


def test_kustomize_renders() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run([kubectl, "kustomize", str(KUBERNETES)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    rendered = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert {doc["kind"] for doc in rendered} == set(kubernetes_objects())
    assert all(doc["metadata"].get("namespace") == "dlprof-agent"
               for doc in rendered if doc["kind"] != "Namespace")


def test_the_locked_component_serves_tls_and_basic_auth(tmp_path: Path) -> None:
    """deploy/kubernetes/locked, added to the kustomization as its comment says: the
    agent reads a web config from the Secret's mount, its probes speak HTTPS, and the
    ServiceMonitor scrapes with the CA and the credentials."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{os.path.relpath(KUBERNETES, tmp_path)}]\n"
        f"components: [{os.path.relpath(KUBERNETES / 'locked', tmp_path)}]\n")
    result = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    rendered = {doc["kind"]: doc for doc in yaml.safe_load_all(result.stdout) if doc}
    agent = agent_container(rendered)
    args = assert_agent_accepts(agent["command"][1:])
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert Path(args.web_config_file).parent == Path(mounts["web-config"])
    volumes = {v["name"]: v for v in pod_spec(rendered)["volumes"]}
    assert volumes["web-config"]["secret"]["secretName"] == "dlprof-agent-web"
    for probe in ("readinessProbe", "livenessProbe"):
        assert agent[probe]["httpGet"]["scheme"] == "HTTPS"
        assert agent[probe]["httpGet"]["path"] == "/healthz"
    (endpoint,) = rendered["ServiceMonitor"]["spec"]["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["port"] == "metrics"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "dlprof-agent-web",
                                                     "key": "tls.crt"}
    assert endpoint["basicAuth"]["password"]["name"] == "dlprof-agent-scrape"
    # The base's endpoint settings are all still there.
    base_endpoint = kubernetes_objects()["ServiceMonitor"]["spec"]["endpoints"][0]
    assert base_endpoint.items() <= endpoint.items()
    # Without the component, the base stays as it was.
    assert "--web.config.file" not in agent_container(kubernetes_objects())["command"]


def test_the_example_web_config_is_one_the_agent_reads(tmp_path: Path) -> None:
    pytest.importorskip("bcrypt")
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed, and the test makes its certificate with it")
    from dlprof_agent.exporters import web_config

    config = tmp_path / "web-config.yml"
    shutil.copy(KUBERNETES / "locked" / "web-config.yml.example", config)
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=dlprof-agent", "-addext", "subjectAltName=DNS:dlprof-agent",
                    "-keyout", str(tmp_path / "tls.key"), "-out", str(tmp_path / "tls.crt")],
                   check=True, capture_output=True, timeout=60)
    loaded = web_config.load(config)
    assert loaded.tls is not None and set(loaded.users) == {"prometheus"}


# docker compose.

@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(COMPOSE)


def bind_mounts(service: dict[str, Any]) -> dict[str, Path | str]:
    """Container path -> host path (resolved like compose does, from the file's
    folder) for each bind mount."""
    result: dict[str, Path | str] = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            result[target] = (COMPOSE.parent / source).resolve()
        elif source.startswith("/"):
            result[target] = source
    return result


def test_compose_agent_sees_the_host(compose: dict[str, Any]) -> None:
    agent = compose["services"]["agent"]
    assert agent["pid"] == "host"
    assert "SYS_PTRACE" in agent["cap_add"]
    assert "apparmor=unconfined" in agent["security_opt"]
    assert agent["environment"]["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert (COMPOSE.parent / agent["build"]["context"] / agent["build"]["dockerfile"]).is_file()


def test_compose_agent_command_is_one_the_agent_takes(compose: dict[str, Any]) -> None:
    options = assert_agent_accepts(compose["services"]["agent"]["command"])
    assert options.port == PORT


def test_compose_prometheus_uses_the_deploy_prometheus_config(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    mounts = bind_mounts(prometheus)
    (config,) = [arg.split("=", 1)[1] for arg in prometheus["command"]
                 if arg.startswith("--config.file=")]
    folder = str(Path(config).parent)
    assert mounts[folder] == DEPLOY / "prometheus"
    config_file = DEPLOY / "prometheus" / Path(config).name
    # What prometheus.yml refers to, relative to itself, is inside the mount.
    settings = load(config_file)
    for rule_file in settings.get("rule_files", []):
        assert (config_file.parent / rule_file).exists(), rule_file
    # Everything shares the host's network, so a target on localhost is the agent.
    assert all(s.get("network_mode") == "host" for s in compose["services"].values())
    targets = [target for path in (config_file.parent / "targets").glob("*.json")
               for group in json.loads(path.read_text()) for target in group["targets"]]
    assert f"localhost:{PORT}" in targets


def test_compose_grafana_mounts_the_provisioning(compose: dict[str, Any]) -> None:
    mounts = bind_mounts(compose["services"]["grafana"])
    assert mounts["/etc/grafana/provisioning"] == REPO / "dlprof_agent" / "grafana" / "provisioning"
    (dashboards_at,) = [target for target, source in mounts.items()
                        if source == REPO / "dlprof_agent" / "grafana" / "dashboards"]
    provider = REPO / "dlprof_agent" / "grafana" / "provisioning" / "dashboards" / "dlprof.yaml"
    # The provider loads the dashboards from where compose puts them.
    paths = {p["options"]["path"] for p in load(provider)["providers"]}
    assert dashboards_at in paths


def test_compose_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    used = {volume.split(":")[0] for service in compose["services"].values()
            for volume in service.get("volumes", []) if not volume.startswith((".", "/"))}
    assert used == set(compose["volumes"])


# systemd.

def read_unit(path: Path) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment, method-assign]  # keys are case-sensitive
    unit.read_string(path.read_text())
    return unit


def test_unit_runs_the_daemon_with_ptrace() -> None:
    service = read_unit(UNIT)["Service"]
    command = shlex.split(service["ExecStart"])
    assert command[1:4] == ["daemon", "--listen", "0.0.0.0"]
    assert service["Restart"] == "on-failure"
    assert service["EnvironmentFile"] == "-/etc/default/dlprof-agent"
    assert "CAP_SYS_PTRACE" in service["CapabilityBoundingSet"].split()
    # Settings that would hide what the agent reads.
    assert service.get("PrivateTmp", "no") == "no"
    assert service.get("ProtectProc", "default") == "default"
    assert service.get("PrivateDevices", "no") == "no"
    assert "ProtectClock" not in service
    assert "User" not in service  # root: probes accept only their own user or root


def test_unit_command_is_one_the_agent_takes() -> None:
    command = shlex.split(read_unit(UNIT)["Service"]["ExecStart"])
    assert_agent_accepts([arg for arg in command[1:] if arg != "$DLPROF_AGENT_ARGS"])


def test_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify checks that the command exists: point it at a stand-in.
    executable = tmp_path / "dlprof-agent"
    executable.write_text("#!/bin/sh\n")
    executable.chmod(0o755)
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/dlprof-agent", str(executable)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                            timeout=60, check=False)
    # Unknown or misspelt settings are only warnings, on stderr.
    complaints = [line for line in (result.stdout + result.stderr).splitlines()
                  if UNIT.name in line]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr


def test_environment_file_example_is_shell_syntax() -> None:
    example = DEPLOY / "systemd" / "dlprof-agent.default"
    result = subprocess.run([BASH, "-c", f'. "{example}" && echo "$DLPROF_AGENT_ARGS"'],
                            capture_output=True, text=True, timeout=10, check=False)
    assert result.returncode == 0, result.stderr


# Shell scripts.

@pytest.mark.parametrize("path", [*LINTED_SCRIPTS, DEPLOY / "slurm" / "slurm.conf.example"],
                         ids=lambda p: p.name)
def test_bash_syntax(path: Path) -> None:
    result = subprocess.run([BASH, "-n", str(path)], capture_output=True, text=True,
                            timeout=10, check=False)
    assert result.returncode == 0, result.stderr


def test_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (apt install shellcheck)")
    result = subprocess.run([shellcheck, *map(str, LINTED_SCRIPTS)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout


# SLURM prolog and epilog, run for real against a stand-in agent.

FAKE_AGENT = """\
#!{python}
# Stands in for dlprof-agent: records how it was started, then listens on --port.
import json, os, signal, socket, sys, time
with open(os.environ["FAKE_RECORD"], "w") as record:
    json.dump({{"argv": sys.argv[1:], "pid": os.getpid(), "sid": os.getsid(0)}}, record)
if os.environ.get("FAKE_EXIT"):
    print("cannot listen: port in use", file=sys.stderr)
    sys.exit(int(os.environ["FAKE_EXIT"]))
if os.environ.get("FAKE_IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
server = socket.socket()
server.bind(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])))
server.listen()
time.sleep(30)
"""


# The SLURM tests are one node's job 1234: the real daemon a prolog starts watches
# every process of that job, the stand-in agents of the other tests included, so
# one worker runs them all (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("slurm-job-1234")


def free_port_range(count: int) -> int:
    """The first of ``count`` consecutive ports nothing listens on, from a range
    picked at random: tests running beside this one (xdist workers) each find their
    own instead of all the first free one."""
    bases = list(range(21000, 60000, 97))
    random.shuffle(bases)
    for base in bases:
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise AssertionError("no free port range")


def running(pid: int) -> bool:
    """Alive and not a zombie (the stand-in's parent is gone; init reaps it, or not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    state = next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))
    return state not in ("Z", "X")


class Slurm:
    """A node's view for the scripts: a PATH of the tools they use (and, when
    installed, the stand-in agent), and the environment slurmd gives them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir()
        for tool in SCRIPT_TOOLS:
            found = shutil.which(tool)
            if found:
                (self.bin / tool).symlink_to(found)
            elif tool not in ("setsid", "hostname"):
                pytest.skip(f"{tool} is not installed")
        self.record = root / "record.json"
        self.state = root / "state"
        self.targets = root / "targets"
        self.port_base = free_port_range(5)
        self.env = {
            "PATH": str(self.bin),
            "FAKE_RECORD": str(self.record),
            "DLPROF_SLURM_CONF": str(root / "no-such.conf"),
            "DLPROF_STATE_DIR": str(self.state),
            "DLPROF_TARGETS_DIR": str(self.targets),
            "DLPROF_PORT_BASE": str(self.port_base),
            "DLPROF_PORT_COUNT": "5",
            "DLPROF_TARGET_HOST": "gpu07.cluster",
            "DLPROF_STOP_WAIT": "1",
            "SLURM_JOB_ID": "1234",
            "SLURM_JOB_USER": "alice",
            "SLURM_JOB_PARTITION": "gpu",
            "SLURMD_NODENAME": "gpu07",
        }
        self.started: list[int] = []

    def install_agent(self) -> None:
        agent = self.bin / "dlprof-agent"
        agent.write_text(FAKE_AGENT.format(python=sys.executable))
        agent.chmod(0o755)

    def run(self, script: Path, **env: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([BASH, str(script)], env={**self.env, **env},
                                capture_output=True, text=True, timeout=30, check=False)
        if script == PROLOG and self.record.exists():
            self.started.append(self.agent()["pid"])
        return result

    def agent(self) -> dict[str, Any]:
        record: dict[str, Any] = json.loads(self.record.read_text())
        return record

    @property
    def expected_port(self) -> int:
        return self.port_base + 1234 % 5


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[Slurm]:
    node = Slurm(tmp_path)
    yield node
    for pid in node.started:  # an agent a failed test left behind
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def test_prolog_starts_the_jobs_agent_and_writes_its_target(slurm: Slurm) -> None:
    slurm.install_agent()
    result = slurm.run(PROLOG)
    assert result.returncode == 0, result.stderr
    agent = slurm.agent()
    argv = agent["argv"]
    assert argv[:1] == ["daemon"]
    assert argv[argv.index("--env") + 1] == "SLURM_JOB_ID=1234"
    assert argv[argv.index("--match") + 1] == "python"
    assert argv[argv.index("--listen") + 1] == "0.0.0.0"
    assert int(argv[argv.index("--port") + 1]) == slurm.expected_port
    # Its own session, so slurmd's cleanup of the prolog leaves it running.
    if (slurm.bin / "setsid").exists():
        assert agent["sid"] == agent["pid"]
    assert running(agent["pid"])
    assert (slurm.state / "job-1234.pid").read_text().strip() == str(agent["pid"])

    # The series' labels agree with the target file's: node and job.
    assert argv[argv.index("--node-name") + 1] == "gpu07"
    target = slurm.targets / "gpu07-job-1234.json"
    assert json.loads(target.read_text()) == [{
        "targets": [f"gpu07.cluster:{slurm.expected_port}"],
        "labels": {"slurm_job_id": "1234", "slurm_job_user": "alice",
                   "slurm_partition": "gpu", "slurm_node": "gpu07"},
    }]
    assert [p.name for p in slurm.targets.iterdir()] == [target.name]  # no temporary left
    (written,) = json.loads(target.read_text())
    # No target label that the series carry themselves (Prometheus would rename it).
    assert not set(written["labels"]) & {*JOB_LABELS, *TARGET_INFO_LABELS}

    result = slurm.run(EPILOG)
    assert result.returncode == 0, result.stderr
    assert not running(agent["pid"])
    assert not target.exists()
    assert list(slurm.state.iterdir()) == []


def test_prolog_command_is_one_the_agent_takes(slurm: Slurm) -> None:
    slurm.install_agent()
    slurm.run(PROLOG)
    slurm.run(EPILOG)
    options = assert_agent_accepts(slurm.agent()["argv"])
    assert options.port == slurm.expected_port


def test_prolog_takes_the_next_port_when_the_jobs_is_taken(slurm: Slurm) -> None:
    slurm.install_agent()
    with socket.socket() as other:
        other.bind(("127.0.0.1", slurm.expected_port))
        other.listen()
        assert slurm.run(PROLOG).returncode == 0
    argv = slurm.agent()["argv"]
    port = int(argv[argv.index("--port") + 1])
    assert port != slurm.expected_port
    assert slurm.port_base <= port < slurm.port_base + 5
    target = json.loads((slurm.targets / "gpu07-job-1234.json").read_text())
    assert target[0]["targets"] == [f"gpu07.cluster:{port}"]
    assert slurm.run(EPILOG).returncode == 0


def test_prolog_never_fails_the_job_without_an_agent(slurm: Slurm) -> None:
    result = slurm.run(PROLOG)  # no dlprof-agent on PATH
    assert result.returncode == 0
    assert "dlprof-agent is not installed" in result.stderr
    assert not slurm.targets.exists() or not any(slurm.targets.iterdir())
    assert slurm.run(EPILOG).returncode == 0


def test_prolog_never_fails_the_job_when_the_agent_cannot_start(slurm: Slurm) -> None:
    slurm.install_agent()
    result = slurm.run(PROLOG, FAKE_EXIT="5")
    assert result.returncode == 0
    assert "exited at start" in result.stderr
    assert not any(slurm.targets.iterdir())
    assert not (slurm.state / "job-1234.pid").exists()


def test_scripts_ignore_a_missing_job_id(slurm: Slurm) -> None:
    slurm.install_agent()
    for script in SHELL_SCRIPTS:
        result = slurm.run(script, SLURM_JOB_ID="")
        assert result.returncode == 0
        assert "SLURM_JOB_ID" in result.stderr
    assert not slurm.record.exists()


def test_epilog_kills_an_agent_that_ignores_sigterm(slurm: Slurm) -> None:
    slurm.install_agent()
    assert slurm.run(PROLOG, FAKE_IGNORE_TERM="1").returncode == 0
    pid = slurm.agent()["pid"]
    started = time.monotonic()
    result = slurm.run(EPILOG)
    assert result.returncode == 0
    assert "killing it" in result.stderr
    assert not running(pid)
    assert time.monotonic() - started < 10


def test_epilog_leaves_a_reused_pid_alone(slurm: Slurm) -> None:
    """A pid file whose process is not this job's agent (the pid was reused)."""
    slurm.state.mkdir()
    with subprocess.Popen(["sleep", "30"]) as bystander:
        try:
            (slurm.state / "job-1234.pid").write_text(f"{bystander.pid}\n")
            assert slurm.run(EPILOG).returncode == 0
            assert bystander.poll() is None
        finally:
            bystander.kill()
    assert not (slurm.state / "job-1234.pid").exists()


@pytest.mark.e2e
def test_prolog_runs_the_real_daemon_on_the_jobs_processes_only(slurm: Slurm) -> None:
    """The real agent, started by the prolog, watches the job's python and not
    another job's, and the epilog stops it."""
    agent = Path(sys.executable).parent / "dlprof-agent"
    if not agent.exists():
        pytest.skip("dlprof-agent is not installed beside this Python")
    busy = "import time\nwhile True: time.sleep(0.05)"
    env = {**os.environ, "SLURM_JOB_ID": "1234"}
    with subprocess.Popen([sys.executable, "-c", busy], env=env) as job, \
            subprocess.Popen([sys.executable, "-c", busy],
                             env={**env, "SLURM_JOB_ID": "999"}) as other_job:
        try:
            result = slurm.run(PROLOG, DLPROF_AGENT=str(agent),
                               DLPROF_AGENT_ARGS="--no-probe --no-gpu --scan-interval 0.2",
                               PYTHONPATH=agent_env().get("PYTHONPATH", ""))
            assert result.returncode == 0, result.stderr
            pid = int((slurm.state / "job-1234.pid").read_text())
            slurm.started.append(pid)
            url = f"http://127.0.0.1:{slurm.expected_port}"
            seen: dict[int, str] = {}

            def targets() -> list[int]:
                found = list(json.loads(http_get(f"{url}/healthz")).get("targets") or [])
                for target in found:
                    with contextlib.suppress(OSError):
                        seen.setdefault(target, Path(f"/proc/{target}/cmdline").read_text())
                return found

            # Until the job alone: a short-lived python of job 1234 on a loaded node (a
            # process the daemon rightly takes for the job's) may be watched meanwhile.
            with contextlib.suppress(AssertionError):
                wait_for(lambda: targets() == [job.pid], "the daemon to watch the job", 60)
            assert targets() == [job.pid], seen
            assert f'dlprof_target_up{{pid="{job.pid}"}} 1.0' in http_get(
                f"{url}/metrics").decode()
            assert other_job.pid not in seen

            assert slurm.run(EPILOG).returncode == 0
            assert not running(pid)
            assert not any(slurm.targets.iterdir())
        finally:
            job.kill()
            other_job.kill()
