"""Provisioning Grafana through its HTTP API: the Prometheus data source the
shipped dashboards query, their folder, and the dashboards themselves.

This is the one module that talks to Grafana. It does so through grafana-client,
imported only when a session opens, so `--help` works without it installed. Every
step is an upsert keyed by a fixed uid, so running it again changes nothing that
is already right and never makes a duplicate. Its errors name the options of
`dlprof-agent grafana provision` that would fix them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

from dlprof_agent.errors import DlprofError, GrafanaError, UsageError

# The uid the dashboards' datasource variable is pointed at; the file provisioning in
# grafana/provisioning/datasources/dlprof.yaml uses the same one.
DATASOURCE_UID = "dlprof-prometheus"
OVERVIEW_FILE = "overview.json"
INSTALL_HINT = "pip install 'dlprof-agent[grafana]'"
UID_MAX_LENGTH = 40  # Grafana's limit on a uid

# The roles a step needs, for the hint when Grafana answers 403.
ADMIN = "data sources need the Admin role in the organization: use an admin's login, or a " \
        "service account token with the Admin role"
EDITOR = "folders and dashboards need the Editor role: use a service account token with " \
         "the Editor (or Admin) role"


@dataclass(frozen=True)
class GrafanaUrl:
    scheme: str
    host: str  # a bare name or address; IPv6 without brackets
    port: int | None
    path: str  # the sub-path Grafana is served under: "" or e.g. "/grafana"

    @property
    def base(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = "" if self.port is None else f":{self.port}"
        return f"{self.scheme}://{host}{port}{self.path}"


Credential = str | tuple[str, str]  # a token, or (user, password)


# --- the shipped dashboards ---------------------------------------------------------------


@dataclass(frozen=True)
class Dashboard:
    file: str
    model: dict[str, Any]

    @property
    def uid(self) -> str:
        return str(self.model["uid"])

    @property
    def title(self) -> str:
        return str(self.model.get("title", self.uid))


def shipped_dashboards() -> list[Dashboard]:
    """Every dashboard JSON the package ships, by file name; read now, not listed in
    code, so a new dashboard file is provisioned without a change here."""
    from importlib import resources  # here: every command's parser imports this module

    folder = resources.files("dlprof_agent.grafana") / "dashboards"
    dashboards = []
    for entry in sorted(folder.iterdir(), key=lambda entry: entry.name):
        if not entry.name.endswith(".json"):
            continue
        try:
            model = json.loads(entry.read_text(encoding="utf-8"))
        except ValueError as error:
            raise DlprofError(f"the shipped dashboard {entry.name} is not JSON ({error})",
                             "a packaging bug: please report it") from None
        # Without a uid Grafana would make up a new one each run: a duplicate each time.
        if not isinstance(model, dict) or not isinstance(model.get("uid"), str):
            raise DlprofError(f"the shipped dashboard {entry.name} has no uid",
                             "a packaging bug: please report it")
        dashboards.append(Dashboard(entry.name, model))
    if not dashboards:
        raise DlprofError("no dashboards are shipped with this installation",
                         "reinstall dlprof-agent")
    return dashboards


def folder_uid(title: str) -> str:
    """A uid that follows from the title, so the same --folder finds the same folder."""
    slug = re.sub(r"[^a-z0-9_-]+", "-", title.lower()).strip("-")
    if not slug:  # a title with no Latin letters or digits
        slug = "dlprof-" + hashlib.sha256(title.encode()).hexdigest()[:12]
    return slug[:UID_MAX_LENGTH]


def with_datasource(model: dict[str, Any], uid: str, name: str) -> dict[str, Any]:
    """The dashboard with its Prometheus data source variable defaulting to ours, so it
    shows data at once even where another Prometheus is Grafana's default."""
    model = copy.deepcopy(model)
    model.pop("id", None)  # ids are per Grafana; the uid is what identifies a dashboard
    for variable in model.get("templating", {}).get("list", []):
        if variable.get("type") == "datasource" and variable.get("query") == "prometheus":
            variable["current"] = {"selected": True, "text": name, "value": uid}
    return model


# --- Grafana ----------------------------------------------------------------------------


def _reason(error: Exception) -> str:
    """The useful part of a niquests connection error, which nests urllib3's."""
    text = str(error)
    resolve = re.search(r"Failed to resolve '([^']+)'", text)
    if resolve:
        return f"the name {resolve.group(1)} does not resolve"
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return "its TLS certificate is not trusted here"
    errno_text = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if errno_text:
        return errno_text.group(1).strip().lower()
    return text[:200]


def _message(error: Any) -> str:
    """What Grafana said, from a grafana-client exception."""
    response = getattr(error, "response", None)
    if isinstance(response, dict) and response.get("message"):
        return str(response["message"])
    return str(response or getattr(error, "message", "") or error)[:200].strip()


class GrafanaSession:
    """The Grafana HTTP API through grafana-client, each failure a one-line error."""

    def __init__(self, url: GrafanaUrl, credential: Credential, *, refused_hint: str,
                 timeout: float) -> None:
        try:
            from grafana_client.api import GrafanaApi
        except ImportError:
            raise UsageError("grafana-client is not installed", INSTALL_HINT) from None
        self.url = url
        self.timeout = timeout
        self.refused_hint = refused_hint
        # grafana-client appends "api" to the prefix: a sub-path needs its trailing slash.
        prefix = url.path.lstrip("/") + "/" if url.path else ""
        host = f"[{url.host}]" if ":" in url.host else url.host
        self.api: Any = GrafanaApi(auth=credential, protocol=url.scheme, host=host,
                                   port=url.port, url_path_prefix=prefix, timeout=timeout)

    @contextmanager
    def _errors(self, doing: str, role: str) -> Iterator[None]:
        from grafana_client.client import (
            GrafanaException,
            GrafanaTimeoutError,
            GrafanaUnauthorizedError,
        )
        from niquests.exceptions import ConnectionError as NoConnection
        from niquests.exceptions import Timeout

        where = self.url.base
        try:
            yield
        except GrafanaUnauthorizedError:
            raise GrafanaError(f"Grafana refused the credentials (401 Unauthorized) while "
                               f"{doing}", self.refused_hint) from None
        except (GrafanaTimeoutError, Timeout):
            raise GrafanaError(f"cannot reach Grafana at {where}: no answer within "
                               f"{self.timeout:g} s while {doing}",
                               "check --url, or wait longer with --timeout") from None
        except GrafanaException as error:
            status = error.status_code
            if not status:  # grafana-client's wrapper for a failed HTTP exchange
                raise GrafanaError(f"unexpected answer from {where} while {doing}: "
                                   f"{_message(error)}", "check that --url is Grafana's"
                                   ) from None
            if status == 403:
                raise GrafanaError(f"Grafana refused the credentials while {doing} (403: "
                                   f"{_message(error)})", role) from None
            hint = "see Grafana's log for why"
            if "provision" in _message(error).lower():
                hint = "it was provisioned from files: change those files instead"
            raise GrafanaError(f"Grafana refused {doing} ({status}: {_message(error)})",
                               hint) from None
        except NoConnection as error:
            raise GrafanaError(f"cannot reach Grafana at {where}: {_reason(error)}",
                               "check --url and that Grafana is running") from None
        except OSError as error:  # any other niquests failure: an answer that is not JSON
            raise GrafanaError(f"unexpected answer from {where} while {doing}: "
                               f"{str(error)[:200]}", "check that --url is Grafana's") from None

    def _call(self, doing: str, role: str, call: Callable[[], Any], *,
              missing_ok: bool = False, conflict: DlprofError | None = None
              ) -> dict[str, Any] | None:
        """One request. ``missing_ok``: a 404 is None; ``conflict``: raised on a 409."""
        from grafana_client.client import GrafanaClientError

        with self._errors(doing, role):
            try:
                answer = call()
            except GrafanaClientError as error:
                if error.status_code == 404 and missing_ok:
                    return None
                if error.status_code == 409 and conflict is not None:
                    raise conflict from None
                raise
        if not isinstance(answer, dict):
            raise GrafanaError(f"unexpected answer from {self.url.base} while {doing}: "
                               f"{str(answer)[:100]!r}", "check that --url is Grafana's")
        return answer

    def _require(self, answer: dict[str, Any] | None) -> dict[str, Any]:
        assert answer is not None  # only missing_ok calls give None
        return answer

    def version(self) -> str:
        """Grafana's version, from /api/health: it needs no credentials, so an address
        that is not Grafana is told apart from credentials Grafana refuses."""
        health = self._call("checking its health", EDITOR,
                            lambda: self.api.client.GET("/health"), missing_ok=True)
        if health is None or "database" not in health:
            raise GrafanaError(f"{self.url.base} does not look like Grafana (no /api/health)",
                               "check --url, with any sub-path Grafana is served under")
        return str(health.get("version", "?"))

    def datasource(self, uid: str) -> dict[str, Any] | None:
        return self._call(f"reading data source {uid}", ADMIN,
                          lambda: self.api.datasource.get_datasource_by_uid(uid),
                          missing_ok=True)

    def create_datasource(self, body: dict[str, Any]) -> None:
        self._call(f"creating data source {body['uid']}", ADMIN,
                   lambda: self.api.datasource.create_datasource(body),
                   conflict=self._name_taken(body["name"]))

    def update_datasource(self, body: dict[str, Any]) -> None:
        self._call(f"updating data source {body['uid']}", ADMIN,
                   lambda: self.api.datasource.update_datasource_by_uid(body["uid"], body),
                   conflict=self._name_taken(body["name"]))

    @staticmethod
    def _name_taken(name: str) -> GrafanaError:
        return GrafanaError(f"Grafana already has another data source named {name!r}",
                            "pick another name with --datasource-name")

    def folder(self, uid: str) -> dict[str, Any] | None:
        return self._call(f"reading folder {uid}", EDITOR,
                          lambda: self.api.folder.get_folder(uid), missing_ok=True)

    def folders(self) -> list[dict[str, Any]]:
        doing = "listing folders"
        with self._errors(doing, EDITOR):
            answer = self.api.folder.get_all_folders()
        if not isinstance(answer, list):
            raise GrafanaError(f"unexpected answer from {self.url.base} while {doing}",
                               "check that --url is Grafana's")
        return [entry for entry in answer if isinstance(entry, dict)]

    def create_folder(self, title: str, uid: str) -> dict[str, Any]:
        return self._require(self._call(
            f"creating folder {title!r}", EDITOR,
            lambda: self.api.folder.create_folder(title, uid=uid)))

    def upload_dashboard(self, model: dict[str, Any], folder: str) -> dict[str, Any]:
        payload = {"dashboard": model, "folderUid": folder, "overwrite": True,
                   "message": "dlprof-agent grafana provision"}
        return self._require(self._call(
            f"uploading dashboard {model['uid']}", EDITOR,
            lambda: self.api.dashboard.update_dashboard(payload)))


# --- provisioning -----------------------------------------------------------------------


def ensure_datasource(grafana: GrafanaSession, *, name: str, prometheus_url: str) -> str:
    """Create or update the Prometheus data source; returns what was done."""
    existing = grafana.datasource(DATASOURCE_UID)
    if existing is not None and existing.get("readOnly"):
        # Provisioned from a file: Grafana refuses API changes, and the file is the truth.
        return f"provisioned from a file, left as it is (Prometheus at {existing.get('url')})"
    if existing is not None and existing.get("type") != "prometheus":
        raise GrafanaError(f"data source {DATASOURCE_UID} exists but is of type "
                           f"{existing.get('type')!r}", "delete it in Grafana, then run again")
    # Updating keeps what the user set on it (auth, headers, default-ness, secrets).
    body: dict[str, Any] = dict(existing or {"isDefault": False})
    body.update(uid=DATASOURCE_UID, name=name, type="prometheus", access="proxy",
                url=prometheus_url)
    # timeInterval: the agent is scraped every second; a user's own setting wins.
    body["jsonData"] = {"timeInterval": "1s", **(body.get("jsonData") or {}),
                        "httpMethod": "POST"}
    if existing is None:
        grafana.create_datasource(body)
        return f"created (Prometheus at {prometheus_url})"
    grafana.update_datasource(body)
    return f"updated (Prometheus at {prometheus_url})"


def ensure_folder(grafana: GrafanaSession, title: str) -> tuple[str, str]:
    """The folder's uid, and what was done."""
    uid = folder_uid(title)
    if grafana.folder(uid) is not None:
        return uid, "exists"
    # One the user made by hand, with its own uid: use it rather than clash on the title.
    for entry in grafana.folders():
        if str(entry.get("title", "")).casefold() == title.casefold() and entry.get("uid"):
            return str(entry["uid"]), f"exists (uid {entry['uid']})"
    grafana.create_folder(title, uid)
    return uid, "created"


def provision(grafana: GrafanaSession, dashboards: list[Dashboard], *, folder: str,
              datasource_name: str, prometheus_url: str, out: TextIO) -> str:
    """Does it all, one line per step on ``out``; returns the overview's URL."""
    out.write(f"Grafana {grafana.version()} at {grafana.url.base}\n")
    done = ensure_datasource(grafana, name=datasource_name, prometheus_url=prometheus_url)
    out.write(f"datasource {DATASOURCE_UID}: {done}\n")
    uid, done = ensure_folder(grafana, folder)
    out.write(f"folder {folder}: {done}\n")
    for dashboard in dashboards:
        saved = grafana.upload_dashboard(
            with_datasource(dashboard.model, DATASOURCE_UID, datasource_name), uid)
        version = f", version {saved['version']}" if "version" in saved else ""
        out.write(f"dashboard {dashboard.uid}: uploaded ({dashboard.title!r}{version})\n")
        out.flush()
    overview = next((d for d in dashboards if d.file == OVERVIEW_FILE), dashboards[0])
    # /d/UID redirects to the full address: right behind any proxy that the --url went by.
    return f"{grafana.url.base}/d/{overview.uid}"
