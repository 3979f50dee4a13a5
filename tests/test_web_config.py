"""--web.config.file: /metrics behind basic authentication and TLS, read from the
Prometheus exporters' web configuration format, checked with real scrapes of a
real agent, and with a real Prometheus server scraping it with credentials."""

from __future__ import annotations

import base64
import functools
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlprof_agent.exporters import web_config
from tests.conftest import (
    PROMETHEUS,
    Prometheus,
    agent_env,
    free_port,
    http_get,
    spawn,
    stop,
    wait_for,
)

bcrypt = pytest.importorskip("bcrypt", reason="bcrypt is not installed: "
                             "pip install 'dlprof-agent[web]'")
OPENSSL = shutil.which("openssl")
PASSWORD = "s3cret scrape"


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key."""
    if OPENSSL is None:
        pytest.skip("openssl is not installed, and the test makes its certificate with it")
    cert, key = folder / "agent.crt", folder / "agent.key"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def write_config(folder: Path, *, tls: bool, users: bool) -> Path:
    lines = []
    if tls:
        self_signed(folder)
        # Relative paths: taken from the config file's folder, as the exporter toolkit does.
        lines += ["tls_server_config:", "  cert_file: agent.crt", "  key_file: agent.key"]
    if users:
        hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
        lines += ["basic_auth_users:", f"  prometheus: '{hashed}'"]
    config = folder / "web-config.yml"
    config.write_text("\n".join(lines) + "\n")
    return config


def fetch(url: str, *, password: str | None = None, context: ssl.SSLContext | None = None
          ) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url)
    if password is not None:
        token = base64.b64encode(f"prometheus:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def start_agent(target: int, config: Path | None, port: int,
                listen: str = "127.0.0.1") -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "attach", str(target), "--port", str(port),
         "--listen", listen, "--interval", "0.5", "--quiet", "--no-probe",
         *(["--web.config.file", str(config)] if config else [])],
        env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = spawn(["sleep", "600"])
    yield process
    stop(process)


@pytest.mark.slow  # a real agent serving
def test_basic_auth_refuses_a_scrape_without_credentials_and_serves_one_with_them(
        tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    config = write_config(tmp_path, tls=False, users=True)
    port = free_port()
    agent = start_agent(sleeper.pid, config, port)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: fetch(f"{url}/healthz")[0] == 200, "the agent's /healthz")
        status, headers, _ = fetch(f"{url}/metrics")
        assert status == 401
        assert headers["WWW-Authenticate"].startswith("Basic")
        assert fetch(f"{url}/metrics", password="wrong")[0] == 401
        status, headers, body = fetch(f"{url}/metrics", password=PASSWORD)
        assert status == 200
        assert b"dlprof_target_up{" in body
        # A liveness probe gets the verdict without credentials, and nothing more.
        assert fetch(f"{url}/healthz")[2] == b'{"status": "ok"}'
        assert b"target_pid" in fetch(f"{url}/healthz", password=PASSWORD)[2]
        assert fetch(f"{url}/", password="wrong")[0] == 401
        # The Server header names the agent, and not the Python it runs on.
        assert headers["Server"] == "dlprof-agent"
    finally:
        stop(agent)


@pytest.mark.slow  # a real agent serving TLS
def test_a_tls_scrape_with_a_self_signed_certificate(
        tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    config = write_config(tmp_path, tls=True, users=True)
    port = free_port()
    agent = start_agent(sleeper.pid, config, port)
    try:
        trusting = ssl.create_default_context(cafile=str(tmp_path / "agent.crt"))
        url = f"https://127.0.0.1:{port}"
        wait_for(lambda: fetch(f"{url}/healthz", context=trusting)[0] == 200,
                 "the agent's /healthz over TLS")
        status, _, body = fetch(f"{url}/metrics", password=PASSWORD, context=trusting)
        assert status == 200
        assert b"dlprof_target_up{" in body
        assert fetch(f"{url}/metrics", context=trusting)[0] == 401
        # A client that does not trust the certificate, and one that speaks plain HTTP,
        # get nothing.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            fetch(f"{url}/metrics", password=PASSWORD, context=ssl.create_default_context())
        with pytest.raises((OSError, urllib.error.URLError)):
            http_get(f"http://127.0.0.1:{port}/metrics")
        # The agent still serves after both.
        assert fetch(f"{url}/metrics", password=PASSWORD, context=trusting)[0] == 200
    finally:
        stop(agent)


@pytest.mark.e2e
def test_prometheus_scrapes_over_tls_with_basic_auth(
        tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    if PROMETHEUS is None:
        pytest.fail("the prometheus server is not installed (Debian package `prometheus`)")
    config = write_config(tmp_path, tls=True, users=True)
    port = free_port()
    agent = start_agent(sleeper.pid, config, port)
    (tmp_path / "password").write_text(PASSWORD)
    prometheus_config = tmp_path / "prometheus.yml"
    target = f"static_configs: [{{targets: ['127.0.0.1:{port}']}}]"
    tls = f"tls_config: {{ca_file: {tmp_path / 'agent.crt'}}}"
    prometheus_config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - {{job_name: locked, scheme: https, {tls}, {target},\n"
        f"     basic_auth: {{username: prometheus, password_file: {tmp_path / 'password'}}}}}\n"
        f"  - {{job_name: no_credentials, scheme: https, {tls}, {target}}}\n")
    web_port = free_port()
    server = subprocess.Popen(
        [PROMETHEUS, f"--config.file={prometheus_config}",
         f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{web_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        prometheus = Prometheus(web_port)
        wait_for(lambda: http_get(f"{prometheus.url}/-/ready"), "Prometheus to be ready")
        wait_for(lambda: prometheus.query('dlprof_target_up{job="locked"} == 1'),
                 "Prometheus to scrape the locked agent", timeout=60)
        down = wait_for(lambda: prometheus.query('up{job="no_credentials"}'),
                        "the scrape without credentials")
        assert down[0]["value"][1] == "0"
    finally:
        stop(server)
        stop(agent)


@pytest.mark.parametrize(("text", "message"), [
    ("tls_server_config: {cert_file: missing.crt, key_file: missing.key}", "missing.crt"),
    ("tls_server_config: {cert_file: a.crt}", "needs both cert_file and key_file"),
    ("basic_auth_users: {prometheus: plaintext}", "not a bcrypt hash"),
    ("basic_auth_user: {}", "unknown key basic_auth_user"),
    ("tls_server_config: [", "line"),
    ("tls_server_config: {cert_file: a, key_file: b, cipher_suites: [TLS_AES_128]}",
     "cipher_suites"),
])
def test_a_bad_config_is_a_one_line_error_and_exit_2(tmp_path: Path, text: str,
                                                      message: str) -> None:
    config = tmp_path / "web.yml"
    config.write_text(text + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "dlprof_agent", "attach", "1", "--web.config.file", str(config),
         "--port", "0"], env=agent_env(), capture_output=True, text=True, timeout=60,
        check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("dlprof-agent: error: --web.config.file:")
    assert message in lines[0]


def test_a_missing_file_is_a_one_line_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dlprof_agent", "daemon", "--web.config.file",
         str(tmp_path / "nope.yml")], env=agent_env(), capture_output=True, text=True,
        timeout=60, check=False)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "cannot read" in result.stderr


def test_without_bcrypt_the_error_names_the_pip_command(tmp_path: Path) -> None:
    config = write_config(tmp_path, tls=False, users=True)
    # The agent as it runs where bcrypt is not installed.
    code = ("import sys; sys.modules['bcrypt'] = None; from dlprof_agent.cli.main import main; "
            f"sys.exit(main(['attach', '1', '--web.config.file', {str(config)!r}]))")
    result = subprocess.run([sys.executable, "-c", code], env=agent_env(),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert result.stderr == ("dlprof-agent: error: --web.config.file: basic_auth_users in "
                             f"{config} needs bcrypt: pip install 'dlprof-agent[web]'\n")


@pytest.mark.slow  # a real agent serving
def test_the_agent_starts_without_the_libraries_when_no_file_is_given(
        sleeper: subprocess.Popen[bytes]) -> None:
    code = ("import sys; sys.modules['bcrypt'] = sys.modules['yaml'] = None; "
            "from dlprof_agent.cli.main import main; "
            f"sys.exit(main(['attach', '{sleeper.pid}', '--port', '0', '--duration', '0.3', "
            "'--quiet', '--no-probe']))")
    result = subprocess.run([sys.executable, "-c", code], env=agent_env(),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow  # three real agents
def test_serving_beyond_loopback_without_a_config_warns(
        tmp_path: Path, sleeper: subprocess.Popen[bytes]) -> None:
    ports = [free_port() for _ in range(3)]
    warned = start_agent(sleeper.pid, None, ports[0], listen="0.0.0.0")
    locked = start_agent(sleeper.pid, write_config(tmp_path, tls=False, users=True),
                         ports[1], listen="0.0.0.0")
    local = start_agent(sleeper.pid, None, ports[2])
    for url in [f"http://127.0.0.1:{port}/healthz" for port in ports]:
        wait_for(functools.partial(fetch, url), f"{url} to answer")  # it has warned, or not
    outputs = []
    for agent in (warned, locked, local):
        agent.terminate()
        outputs.append(agent.communicate(timeout=30)[1].decode())
    assert "without TLS or authentication" in outputs[0]
    assert "without TLS or authentication" not in outputs[1]
    assert "without TLS or authentication" not in outputs[2]


def test_credentials_are_checked_once_and_then_remembered(tmp_path: Path) -> None:
    """bcrypt costs tens of ms per check by design; Prometheus sends the same
    credentials every scrape."""
    hashed = bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode()
    (tmp_path / "web.yml").write_text(f"basic_auth_users: {{alice: '{hashed}'}}\n")
    config = web_config.load(tmp_path / "web.yml")
    good = "Basic " + base64.b64encode(b"alice:pw").decode()
    wrong = "Basic " + base64.b64encode(b"alice:PW").decode()
    assert config.known(good) is None  # only a bcrypt check can tell
    assert config.authorized(good)
    assert not config.authorized(wrong)
    assert not config.authorized("Basic " + base64.b64encode(b"mallory:pw").decode())
    assert not config.authorized("Basic !!!")
    assert not config.authorized(None)
    # Told without a check from now on; a malformed header never needed one.
    assert config.known(good) is True
    assert config.known(wrong) is False
    assert config.known("Basic !!!") is False
    assert config.known(None) is False
