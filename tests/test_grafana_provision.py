"""`dlprof-agent grafana provision`, run as a real subprocess against a stand-in for
Grafana's HTTP API: an in-memory server that answers the endpoints the command uses
the way Grafana does, checks credentials, and records every request."""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from dlprof_agent.cli.grafana import (
    DEFAULT_DATASOURCE_NAME,
    DEFAULT_FOLDER,
    DEFAULT_PROMETHEUS_URL,
)
from dlprof_agent.grafana.provision import DATASOURCE_UID, folder_uid
from tests.conftest import agent_env, free_port

# Each test runs the command as a subprocess against the stand-in: seconds apiece.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "dlprof_agent" / "grafana" / "dashboards"
PROVISIONING = REPO / "dlprof_agent" / "grafana" / "provisioning"
ERROR_PREFIX = "dlprof-agent: error:"
TOKEN = "glsa_test-admin-token"
VIEWER_TOKEN = "glsa_test-viewer-token"
ROLES = ("Viewer", "Editor", "Admin")


def shipped() -> dict[str, dict[str, Any]]:
    """The dashboards in the package, read here as the command should: every *.json."""
    models = [json.loads(path.read_text()) for path in sorted(SHIPPED.glob("*.json"))]
    assert models, "no dashboards shipped"
    return {model["uid"]: model for model in models}


@dataclass
class Request:
    method: str
    path: str
    auth: str  # "bearer TOKEN", "basic USER" or ""
    body: Any


@dataclass
class FakeGrafana:
    """Grafana's HTTP API, as much of it as the command uses, state in memory."""

    prefix: str = ""  # the sub-path Grafana is served under, e.g. "/grafana"
    tokens: dict[str, str] = field(default_factory=lambda: {TOKEN: "Admin",
                                                            VIEWER_TOKEN: "Viewer"})
    users: dict[str, tuple[str, str]] = field(
        default_factory=lambda: {"admin": ("s3cret", "Admin")})
    requests: list[Request] = field(default_factory=list)
    datasources: dict[str, dict[str, Any]] = field(default_factory=dict)  # by uid
    folders: dict[str, dict[str, Any]] = field(default_factory=dict)  # by uid
    dashboards: dict[str, dict[str, Any]] = field(default_factory=dict)  # by uid
    next_id: int = 1
    url: str = ""

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def caller(self, header: str) -> tuple[str, str | None]:
        """The credential as recorded, and its role (None: refused)."""
        scheme, _, value = header.partition(" ")
        if scheme == "Bearer":
            return f"bearer {value}", self.tokens.get(value)
        if scheme == "Basic":
            user, _, password = base64.b64decode(value).decode().partition(":")
            known = self.users.get(user)
            return f"basic {user}", known[1] if known and known[0] == password else None
        return "", None

    def handle(self, method: str, path: str, header: str, body: Any
               ) -> tuple[int, Any]:
        auth, role = self.caller(header)
        self.requests.append(Request(method, path, auth, copy.deepcopy(body)))
        if not path.startswith(self.prefix + "/api/"):
            return 404, "<html>not found</html>"
        route = path[len(self.prefix) + len("/api"):]
        if (method, route) == ("GET", "/health"):  # Grafana answers it without credentials
            return 200, {"commit": "0000000", "database": "ok", "version": "11.3.0"}
        if role is None:
            return 401, {"message": "invalid API key" if auth.startswith("bearer")
                         else "Invalid username or password"}

        def allowed(needed: str) -> bool:
            return ROLES.index(role) >= ROLES.index(needed)

        denied = 403, {"message": "You'll need additional permissions to perform this "
                                  "action."}
        if match := re.fullmatch(r"/datasources/uid/([^/]+)", route):
            if not allowed("Admin"):
                return denied
            return self.datasource(method, match.group(1), body)
        if (method, route) == ("POST", "/datasources"):
            return self.create_datasource(body) if allowed("Admin") else denied
        if match := re.fullmatch(r"/folders/([^/]+)", route):
            if method != "GET":
                return 405, {"message": "method not allowed"}
            found = self.folders.get(match.group(1))
            return (200, found) if found else (404, {"message": "folder not found"})
        if route == "/folders":
            if method == "GET":
                return 200, [{"id": f["id"], "uid": f["uid"], "title": f["title"]}
                             for f in self.folders.values()]
            return self.create_folder(body) if allowed("Editor") else denied
        if (method, route) == ("POST", "/dashboards/db"):
            return self.save_dashboard(body) if allowed("Editor") else denied
        return 404, {"message": "Not found"}

    def name_taken(self, name: str, uid: str) -> bool:
        return any(ds["name"] == name and ds["uid"] != uid for ds in self.datasources.values())

    def datasource(self, method: str, uid: str, body: Any) -> tuple[int, Any]:
        existing = self.datasources.get(uid)
        if existing is None:
            return 404, {"message": "Data source not found"}
        if method == "GET":
            return 200, existing
        if method != "PUT":
            return 405, {"message": "method not allowed"}
        if existing["readOnly"]:
            return 403, {"message": "Cannot update read-only data source"}
        if self.name_taken(body["name"], uid):
            return 409, {"message": "data source with the same name already exists"}
        if body.get("version", existing["version"]) < existing["version"]:
            return 409, {"message": "Datasource has already been updated by someone else"}
        updated = {**body, "id": existing["id"], "uid": uid, "orgId": 1, "readOnly": False,
                   "version": existing["version"] + 1}
        self.datasources[uid] = updated
        return 200, {"datasource": updated, "id": updated["id"], "name": updated["name"],
                     "message": "Datasource updated"}

    def create_datasource(self, body: Any) -> tuple[int, Any]:
        if not body.get("name") or not body.get("type") or not body.get("access"):
            return 400, {"message": "bad request data"}
        uid = body.get("uid") or f"generated-{self.next_id}"
        if uid in self.datasources or self.name_taken(body["name"], uid):
            return 409, {"message": "data source with the same name already exists"}
        created = {**body, "id": self.new_id(), "uid": uid, "orgId": 1, "readOnly": False,
                   "version": 1}
        self.datasources[uid] = created
        return 200, {"datasource": created, "id": created["id"], "name": created["name"],
                     "message": "Datasource added"}

    def create_folder(self, body: Any) -> tuple[int, Any]:
        uid = body.get("uid") or f"generated-{self.next_id}"
        if uid in self.folders or any(f["title"].casefold() == body["title"].casefold()
                                      for f in self.folders.values()):
            return 409, {"message": "a folder with the same name already exists"}
        folder = {"id": self.new_id(), "uid": uid, "title": body["title"],
                  "url": f"{self.prefix}/dashboards/f/{uid}/", "version": 1}
        self.folders[uid] = folder
        return 200, folder

    def save_dashboard(self, body: Any) -> tuple[int, Any]:
        model, folder = body["dashboard"], body.get("folderUid", "")
        if folder and folder not in self.folders:
            return 400, {"message": "folder not found"}
        uid = model.get("uid") or f"generated-{self.next_id}"
        existing = self.dashboards.get(uid)
        same_title = [d for d in self.dashboards.values() if d["folderUid"] == folder
                      and d["dashboard"]["title"] == model["title"] and d["uid"] != uid]
        if (existing or same_title) and not body.get("overwrite"):
            return 412, {"message": "A dashboard with the same uid or name already exists",
                         "status": "name-exists"}
        for other in same_title:  # what overwrite does to a clash on the title
            del self.dashboards[other["uid"]]
        version = existing["version"] + 1 if existing else 1
        slug = re.sub(r"[^a-z0-9]+", "-", model["title"].lower()).strip("-")
        self.dashboards[uid] = {"uid": uid, "dashboard": copy.deepcopy(model),
                                "folderUid": folder, "version": version,
                                "id": existing["id"] if existing else self.new_id()}
        return 200, {"id": self.dashboards[uid]["id"], "uid": uid, "slug": slug,
                     "url": f"{self.prefix}/d/{uid}/{slug}", "status": "success",
                     "version": version}

    def state(self) -> dict[str, Any]:
        """What a user would see in Grafana; versions aside, which count the saves."""
        def strip(record: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in record.items() if k != "version"}
        return {"datasources": {k: strip(v) for k, v in self.datasources.items()},
                "folders": {k: strip(v) for k, v in self.folders.items()},
                "dashboards": {k: strip(v) for k, v in self.dashboards.items()}}

    def calls(self) -> list[tuple[str, str]]:
        return [(r.method, r.path) for r in self.requests]


def _handler(fake: FakeGrafana) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            status, answer = fake.handle(self.command, urlsplit(self.path).path,
                                         self.headers.get("Authorization", ""), body)
            is_json = not isinstance(answer, str)
            data = (json.dumps(answer) if is_json else answer).encode()
            self.send_response(status)
            self.send_header("Content-Type",
                             "application/json" if is_json else "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def serve(fake: FakeGrafana) -> Iterator[FakeGrafana]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}{fake.prefix}"
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    yield from serve(FakeGrafana())


def provision(*args: str, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in agent_env().items() if k != "GRAFANA_TOKEN"}
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "dlprof_agent", "grafana", "provision", *args],
                          env=environment, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL, check=False)


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(ERROR_PREFIX), lines[0]
    assert result.returncode == code, result.stderr
    return lines[0]


def assert_provisioned(grafana: FakeGrafana) -> None:
    """One data source, one folder, and exactly the shipped dashboards in it."""
    assert list(grafana.datasources) == [DATASOURCE_UID]
    datasource = grafana.datasources[DATASOURCE_UID]
    assert (datasource["type"], datasource["access"]) == ("prometheus", "proxy")
    assert datasource["isDefault"] is False
    assert list(grafana.folders) == [folder_uid(DEFAULT_FOLDER)]
    assert grafana.folders[folder_uid(DEFAULT_FOLDER)]["title"] == DEFAULT_FOLDER
    expected = shipped()
    assert set(grafana.dashboards) == set(expected)
    for uid, saved in grafana.dashboards.items():
        assert saved["folderUid"] == folder_uid(DEFAULT_FOLDER)
        assert saved["dashboard"]["title"] == expected[uid]["title"]


# --- what works ----------------------------------------------------------------------


def test_first_run_creates_the_datasource_folder_and_every_dashboard(
        grafana: FakeGrafana) -> None:
    result = provision("--url", grafana.url, "--token", TOKEN)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    dashboards = shipped()
    assert grafana.calls() == [
        ("GET", "/api/health"),
        ("GET", f"/api/datasources/uid/{DATASOURCE_UID}"),
        ("POST", "/api/datasources"),
        ("GET", f"/api/folders/{DEFAULT_FOLDER}"),
        ("GET", "/api/folders"),
        ("POST", "/api/folders"),
        *[("POST", "/api/dashboards/db")] * len(dashboards)]
    assert all(r.auth == f"bearer {TOKEN}" for r in grafana.requests)

    created = grafana.requests[2].body
    assert {k: created[k] for k in ("uid", "name", "type", "access", "url", "isDefault")} == {
        "uid": DATASOURCE_UID, "name": DEFAULT_DATASOURCE_NAME, "type": "prometheus",
        "access": "proxy", "url": DEFAULT_PROMETHEUS_URL, "isDefault": False}
    assert grafana.requests[5].body == {"title": DEFAULT_FOLDER, "uid": DEFAULT_FOLDER}

    # The uploads are the shipped files, as they are, with the data source variable
    # defaulting to the data source just made.
    uploads = [r.body for r in grafana.requests[6:]]
    assert sorted(u["dashboard"]["uid"] for u in uploads) == sorted(dashboards)
    for upload in uploads:
        assert upload["folderUid"] == DEFAULT_FOLDER
        assert upload["overwrite"] is True
        model = upload["dashboard"]
        original = dashboards[model["uid"]]
        variables = model["templating"]["list"]
        pointed = [v for v in variables if v["type"] == "datasource"]
        assert pointed, "a shipped dashboard without a data source variable"
        for variable in pointed:
            assert variable.pop("current")["value"] == DATASOURCE_UID
        assert model == original

    assert_provisioned(grafana)
    lines = result.stdout.splitlines()
    assert lines[0] == f"Grafana 11.3.0 at {grafana.url}"
    assert lines[1].startswith(f"datasource {DATASOURCE_UID}: created")
    assert lines[2] == f"folder {DEFAULT_FOLDER}: created"
    assert sorted(line.split(":")[0] for line in lines[3:-1]) == \
        sorted(f"dashboard {uid}" for uid in dashboards)
    assert all(": uploaded" in line for line in lines[3:-1])
    assert lines[-1] == f"overview: {grafana.url}/d/dlprof-overview"


def test_a_second_run_changes_nothing_and_duplicates_nothing(grafana: FakeGrafana) -> None:
    first = provision("--url", grafana.url, "--token", TOKEN)
    assert first.returncode == 0, first.stderr
    after_first = grafana.state()
    grafana.requests.clear()

    second = provision("--url", grafana.url, "--token", TOKEN)
    assert second.returncode == 0, second.stderr
    assert grafana.state() == after_first
    assert_provisioned(grafana)
    # An update in place, no second folder, and the same dashboards overwritten.
    assert grafana.calls() == [
        ("GET", "/api/health"),
        ("GET", f"/api/datasources/uid/{DATASOURCE_UID}"),
        ("PUT", f"/api/datasources/uid/{DATASOURCE_UID}"),
        ("GET", f"/api/folders/{DEFAULT_FOLDER}"),
        *[("POST", "/api/dashboards/db")] * len(shipped())]
    assert f"datasource {DATASOURCE_UID}: updated" in second.stdout
    assert f"folder {DEFAULT_FOLDER}: exists" in second.stdout
    assert all(d["version"] == 2 for d in grafana.dashboards.values())


def test_basic_auth_works(grafana: FakeGrafana) -> None:
    result = provision("--url", grafana.url, "--user", "admin", "--password", "s3cret")
    assert result.returncode == 0, result.stderr
    assert {r.auth for r in grafana.requests} == {"basic admin"}
    assert_provisioned(grafana)


def test_the_token_can_come_from_grafana_token(grafana: FakeGrafana) -> None:
    result = provision("--url", grafana.url, env={"GRAFANA_TOKEN": TOKEN})
    assert result.returncode == 0, result.stderr
    assert {r.auth for r in grafana.requests} == {f"bearer {TOKEN}"}


def test_an_update_keeps_the_users_settings_and_takes_the_new_url(
        grafana: FakeGrafana) -> None:
    assert provision("--url", grafana.url, "--token", TOKEN).returncode == 0
    grafana.datasources[DATASOURCE_UID]["basicAuth"] = True  # set by hand in Grafana
    grafana.datasources[DATASOURCE_UID]["jsonData"]["timeInterval"] = "5s"
    result = provision("--url", grafana.url, "--token", TOKEN,
                       "--prometheus-url", "http://prometheus:9090/")
    assert result.returncode == 0, result.stderr
    datasource = grafana.datasources[DATASOURCE_UID]
    assert datasource["url"] == "http://prometheus:9090"
    assert datasource["basicAuth"] is True
    assert datasource["jsonData"] == {"httpMethod": "POST", "timeInterval": "5s"}


def test_a_file_provisioned_datasource_is_left_alone(grafana: FakeGrafana) -> None:
    grafana.datasources[DATASOURCE_UID] = {
        "id": 1, "uid": DATASOURCE_UID, "name": "from-file", "type": "prometheus",
        "access": "proxy", "url": "http://elsewhere:9090", "readOnly": True, "version": 1}
    result = provision("--url", grafana.url, "--token", TOKEN)
    assert result.returncode == 0, result.stderr
    assert "provisioned from a file, left as it is" in result.stdout
    assert not any(method == "PUT" for method, _ in grafana.calls())
    assert grafana.datasources[DATASOURCE_UID]["url"] == "http://elsewhere:9090"


def test_an_existing_folder_of_that_title_is_used(grafana: FakeGrafana) -> None:
    grafana.folders["hand-made"] = {"id": 1, "uid": "hand-made", "title": "Training Jobs"}
    result = provision("--url", grafana.url, "--token", TOKEN, "--folder", "Training Jobs")
    assert result.returncode == 0, result.stderr
    assert ("POST", "/api/folders") not in grafana.calls()
    assert list(grafana.folders) == ["hand-made"]
    assert {d["folderUid"] for d in grafana.dashboards.values()} == {"hand-made"}


def test_a_grafana_under_a_sub_path() -> None:
    for fake in serve(FakeGrafana(prefix="/grafana")):
        result = provision("--url", fake.url + "/", "--token", TOKEN)
        assert result.returncode == 0, result.stderr
        assert all(path.startswith("/grafana/api/") for _, path in fake.calls())
        assert result.stdout.splitlines()[-1] == f"overview: {fake.url}/d/dlprof-overview"


def test_help_teaches_and_needs_no_grafana_client() -> None:
    # --help must work where grafana-client is not installed: block its import.
    code = ("import sys; sys.modules['grafana_client'] = None\n"
            "from dlprof_agent.cli.main import main\n"
            "try:\n    main(['grafana', 'provision', '--help'])\n"
            "except SystemExit as stop:\n    sys.exit(stop.code)\n")
    result = subprocess.run([sys.executable, "-c", code], env=agent_env(),
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "examples:" in result.stdout and "exit codes" in result.stdout
    assert "--prometheus-url" in result.stdout and "GRAFANA_TOKEN" in result.stdout


# --- what fails, in one line ------------------------------------------------------------


def test_a_wrong_token_is_refused_in_one_line(grafana: FakeGrafana) -> None:
    result = provision("--url", grafana.url, "--token", "glsa_wrong")
    line = assert_one_line_error(result, 7)
    assert "Grafana refused the credentials" in line
    assert "--token" in line  # the hint
    assert grafana.datasources == {} and grafana.dashboards == {}


def test_a_wrong_password_is_refused_in_one_line(grafana: FakeGrafana) -> None:
    result = provision("--url", grafana.url, "--user", "admin", "--password", "nope")
    line = assert_one_line_error(result, 7)
    assert "Grafana refused the credentials" in line and "--password" in line


def test_a_viewer_token_is_told_the_role_it_needs(grafana: FakeGrafana) -> None:
    result = provision("--url", grafana.url, "--token", VIEWER_TOKEN)
    line = assert_one_line_error(result, 7)
    assert "403" in line and "Admin role" in line


def test_nothing_listening_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    line = assert_one_line_error(provision("--url", url, "--token", TOKEN), 7)
    assert f"cannot reach Grafana at {url}" in line and "refused" in line


def test_a_name_that_does_not_resolve_is_one_line() -> None:
    line = assert_one_line_error(
        provision("--url", "http://no-such-host.invalid:3000", "--token", TOKEN), 7)
    assert "cannot reach Grafana" in line and "no-such-host.invalid" in line


def test_a_grafana_that_never_answers_times_out_in_one_line() -> None:
    with socket.socket() as silent:  # accepts connections (the backlog), answers nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        result = provision("--url", url, "--token", TOKEN, "--timeout", "0.5")
    line = assert_one_line_error(result, 7)
    assert "no answer within 0.5 s" in line


def test_something_that_is_not_grafana_is_one_line(grafana: FakeGrafana) -> None:
    line = assert_one_line_error(provision("--url", grafana.url + "/elsewhere", "--token",
                                           TOKEN), 7)
    assert "does not look like Grafana" in line


def test_a_datasource_name_taken_by_another_is_one_line(grafana: FakeGrafana) -> None:
    grafana.datasources["theirs"] = {"id": 1, "uid": "theirs", "name": "Prometheus",
                                     "type": "prometheus", "readOnly": False, "version": 1}
    result = provision("--url", grafana.url, "--token", TOKEN, "--datasource-name",
                       "Prometheus")
    line = assert_one_line_error(result, 7)
    assert "--datasource-name" in line


@pytest.mark.parametrize("args, says", [
    (["--url", "http://localhost:3000"], "no Grafana credentials"),
    (["--url", "http://localhost:3000", "--user", "admin"], "--user and --password"),
    (["--url", "http://localhost:3000", "--token", "t", "--user", "a", "--password", "b"],
     "not both"),
    (["--url", "localhost:3000", "--token", "t"], "not an http:// or https:// URL"),
    (["--url", "http://localhost:port", "--token", "t"], "is not a URL"),
    (["--url", "http://admin:admin@localhost:3000", "--token", "t"], "credentials in it"),
    (["--url", "http://localhost:3000", "--token", "t", "--prometheus-url", "prometheus"],
     "--prometheus-url"),
    (["--token", "t"], "--url"),
    (["--url", "http://localhost:3000", "--token", "t", "--timeout", "0"], "out of range"),
], ids=["no-credentials", "user-alone", "token-and-user", "no-scheme", "bad-port",
        "credentials-in-url", "bad-prometheus-url", "no-url", "zero-timeout"])
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], says: str) -> None:
    line = assert_one_line_error(provision(*args), 2)
    assert says in line


def test_without_grafana_client_it_says_what_to_install(grafana: FakeGrafana) -> None:
    code = ("import sys; sys.modules['grafana_client'] = None\n"
            "from dlprof_agent.cli.main import main\n"
            f"sys.exit(main(['grafana', 'provision', '--url', {grafana.url!r}, "
            f"'--token', {TOKEN!r}]))\n")
    result = subprocess.run([sys.executable, "-c", code], env=agent_env(),
                            capture_output=True, text=True, timeout=60, check=False)
    line = assert_one_line_error(result, 2)
    assert "pip install 'dlprof-agent[grafana]'" in line
    assert grafana.requests == []


# --- file provisioning ------------------------------------------------------------------


def test_the_provisioning_files_match_what_the_command_creates(grafana: FakeGrafana) -> None:
    result = provision("--url", grafana.url, "--token", TOKEN)
    assert result.returncode == 0, result.stderr
    (created,) = grafana.datasources.values()
    (folder,) = grafana.folders.values()

    datasources = yaml.safe_load((PROVISIONING / "datasources" / "dlprof.yaml").read_text())
    assert datasources["apiVersion"] == 1
    (datasource,) = datasources["datasources"]
    for key in ("uid", "name", "type", "access", "url", "isDefault"):
        assert datasource[key] == created[key], key

    providers = yaml.safe_load((PROVISIONING / "dashboards" / "dlprof.yaml").read_text())
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert (provider["folder"], provider["folderUid"]) == (folder["title"], folder["uid"])
    assert os.path.isabs(provider["options"]["path"])
    # The dashboards the file provider loads point at the data source by variable, so
    # the uid in the data source file is the one they find.
    for model in shipped().values():
        assert any(v["type"] == "datasource" and v["query"] == datasource["type"]
                   for v in model["templating"]["list"])
