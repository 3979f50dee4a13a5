"""The web configuration file of the Prometheus exporters (``--web.config.file``):
TLS and basic authentication for /metrics, in the format node_exporter and
dcgm-exporter read (github.com/prometheus/exporter-toolkit, docs/web-configuration.md).

Supported: ``tls_server_config`` (``cert_file``, ``key_file``, ``client_ca_file``,
``client_auth_type``, ``min_version``, ``max_version``), ``basic_auth_users``
(bcrypt hashes, as ``htpasswd -nBC 10 USER`` writes them) and
``http_server_config.headers``. Relative paths are taken from the file's own
folder, as the toolkit does. A key the toolkit knows but this server cannot honour
(Go cipher suite names, curve preferences) is an error, never silently ignored.

PyYAML reads the file and bcrypt checks the passwords (``pip install
'dlprof-agent[web]'``); both are imported only when a file is given.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import ssl
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlprof_agent.errors import MissingLibrary, WebConfigError

INSTALL_HINT = "pip install 'dlprof-agent[web]'"
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
# The toolkit's client_auth_type values that Python's ssl can honour. RequestClientCert
# and RequireAnyClientCert take a certificate without verifying it, which ssl cannot.
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
KNOWN_KEYS = {
    "": {"tls_server_config", "http_server_config", "basic_auth_users"},
    "tls_server_config": {"cert_file", "key_file", "client_ca_file", "client_auth_type",
                          "min_version", "max_version", "cipher_suites",
                          "curve_preferences", "prefer_server_cipher_suites",
                          "client_allowed_sans", "cert", "key"},
    "http_server_config": {"http2", "headers"},
}
UNSUPPORTED = {"cipher_suites": "Go cipher suite names",
               "curve_preferences": "Go curve names",
               "client_allowed_sans": "client SAN filtering",
               "cert": "inline certificates", "key": "inline keys"}
# A bcrypt check costs tens of milliseconds by design; Prometheus sends the same
# credentials every scrape, so each answer is kept. Successes and failures are kept
# apart: a flood of new wrong passwords must not push out the scraper's good one.
CHECKS_KEPT = 256


@dataclass(frozen=True)
class WebConfig:
    path: Path
    tls: ssl.SSLContext | None = None
    # user -> bcrypt hash
    users: dict[str, bytes] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    # What an unknown user's attempt is checked against, so that it costs as much.
    decoy_hash: bytes = field(default=b"", repr=False)
    # The key of the checks' cache, drawn per process: the cache binds the user, the
    # stored hash and the password, as exporter-toolkit's has since CVE-2022-46146,
    # but holds only an HMAC of them, useless outside this process.
    _cache_key: bytes = field(default_factory=lambda: os.urandom(32), repr=False,
                              compare=False)
    _granted: OrderedDict[bytes, None] = field(default_factory=OrderedDict, repr=False,
                                               compare=False)
    _refused: OrderedDict[bytes, None] = field(default_factory=OrderedDict, repr=False,
                                               compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False,
                                  compare=False)

    @property
    def requires_auth(self) -> bool:
        return bool(self.users)

    def known(self, authorization: str | None) -> bool | None:
        """The verdict on an ``Authorization`` header value when it needs no bcrypt
        check (no users, a malformed header, or credentials checked before); None when
        only ``authorized`` can tell."""
        if not self.users:
            return True
        credentials = _credentials(authorization)
        if credentials is None:
            return False
        key = self._key(*credentials)
        with self._lock:
            for kept, verdict in ((self._granted, True), (self._refused, False)):
                if key in kept:
                    kept.move_to_end(key)
                    return verdict
        return None

    def authorized(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value names a user and their password;
        a bcrypt check (tens of ms) unless ``known`` tells."""
        verdict = self.known(authorization)
        if verdict is not None:
            return verdict
        credentials = _credentials(authorization)
        assert credentials is not None  # known() said False otherwise
        user, password = credentials
        import bcrypt

        try:
            ok = bcrypt.checkpw(password.encode("utf-8"), self._hash_of(user))
        except ValueError:
            ok = False
        ok = ok and user in self.users
        kept = self._granted if ok else self._refused
        with self._lock:
            kept[self._key(user, password)] = None
            while len(kept) > CHECKS_KEPT:
                kept.popitem(last=False)
        return ok

    def _hash_of(self, user: str) -> bytes:
        # An unknown user costs a check too, so timing does not tell which users exist.
        return self.users.get(user, self.decoy_hash)

    def _key(self, user: str, password: str) -> bytes:
        message = b":".join(part.hex().encode() for part in (
            user.encode("utf-8"), self._hash_of(user), password.encode("utf-8")))
        return hmac.new(self._cache_key, message, hashlib.sha256).digest()


def _credentials(authorization: str | None) -> tuple[str, str] | None:
    """The user and password of a Basic ``Authorization`` value; None when malformed."""
    if not authorization or not authorization.startswith("Basic "):
        return None
    try:
        user, _, password = base64.b64decode(authorization[6:].strip(), validate=True
                                             ).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return user, password


def _load_yaml(path: Path) -> Any:
    try:
        import yaml
    except ImportError:
        raise MissingLibrary(f"reading {path} needs PyYAML: {INSTALL_HINT}") from None
    try:
        text = path.read_text()
    except OSError as error:
        raise WebConfigError(f"cannot read the web config {path}: {error.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(error, "problem", None) or "not valid YAML"
        raise WebConfigError(f"{path}{where}: {problem}") from None


def _section(document: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    value = document.get(name) or {}
    if not isinstance(value, dict):
        raise WebConfigError(f"{path}: {name} must be a mapping")
    unknown = sorted(set(value) - KNOWN_KEYS[name])
    if unknown:
        raise WebConfigError(f"{path}: unknown key {name}.{unknown[0]}")
    return value


def _text(section: dict[str, Any], key: str, name: str, path: Path) -> str:
    value = section.get(key)
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise WebConfigError(f"{path}: {name}.{key} must be a string")
    return value


def _tls_context(tls: dict[str, Any], path: Path) -> ssl.SSLContext | None:
    for key, what in UNSUPPORTED.items():
        if tls.get(key):
            raise WebConfigError(f"{path}: tls_server_config.{key} ({what}) is not supported "
                                 "by dlprof-agent; leave it out")
    if not tls:
        return None
    cert_file = _text(tls, "cert_file", "tls_server_config", path)
    key_file = _text(tls, "key_file", "tls_server_config", path)
    if not cert_file or not key_file:
        raise WebConfigError(f"{path}: tls_server_config needs both cert_file and key_file")
    base = path.parent
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # the toolkit's default
    for key, attribute in (("min_version", "minimum_version"),
                           ("max_version", "maximum_version")):
        name = _text(tls, key, "tls_server_config", path)
        if name:
            if name not in TLS_VERSIONS:
                raise WebConfigError(f"{path}: tls_server_config.{key} {name!r} is not one of "
                                     f"{', '.join(TLS_VERSIONS)}")
            setattr(context, attribute, TLS_VERSIONS[name])
    cert_path, key_path = base / cert_file, base / key_file
    try:
        context.load_cert_chain(cert_path, key_path)
    except FileNotFoundError as error:
        raise WebConfigError(f"{path}: cannot read {error.filename or cert_path}") from None
    except (ssl.SSLError, OSError) as error:
        raise WebConfigError(f"{path}: cannot load the certificate {cert_path} with the key "
                             f"{key_path}: {getattr(error, 'reason', None) or error}"
                             ) from None
    auth_type = _text(tls, "client_auth_type", "tls_server_config", path) or "NoClientCert"
    client_ca = _text(tls, "client_ca_file", "tls_server_config", path)
    if auth_type not in CLIENT_AUTH:
        raise WebConfigError(f"{path}: tls_server_config.client_auth_type {auth_type!r} is "
                             f"not supported: use one of {', '.join(CLIENT_AUTH)}")
    if CLIENT_AUTH[auth_type] != ssl.CERT_NONE and not client_ca:
        raise WebConfigError(f"{path}: client_auth_type {auth_type} needs client_ca_file")
    if client_ca:
        try:
            context.load_verify_locations(cafile=base / client_ca)
        except (ssl.SSLError, OSError) as error:
            raise WebConfigError(f"{path}: cannot load client_ca_file {base / client_ca}: "
                                 f"{getattr(error, 'reason', None) or error}") from None
    context.verify_mode = CLIENT_AUTH[auth_type]
    return context


def _users(value: Any, path: Path) -> dict[str, bytes]:
    if not value:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"{path}: basic_auth_users must map user names to bcrypt hashes")
    users: dict[str, bytes] = {}
    for user, hashed in value.items():
        if not isinstance(user, str) or not isinstance(hashed, str) or \
                not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            raise WebConfigError(f"{path}: basic_auth_users.{user} is not a bcrypt hash "
                                 "(make one with `htpasswd -nBC 10 USER`)")
        if ":" in user:
            raise WebConfigError(f"{path}: basic_auth_users: {user!r} has a ':'")
        users[user] = hashed.encode()
    try:
        import bcrypt  # imported now, so that a missing library fails at start
    except ImportError:
        raise MissingLibrary(f"basic_auth_users in {path} needs bcrypt: {INSTALL_HINT}"
                             ) from None
    for user, hashed in users.items():
        try:
            bcrypt.checkpw(b"", hashed)
        except ValueError:
            raise WebConfigError(f"{path}: basic_auth_users.{user} is not a valid bcrypt "
                                 "hash") from None
    return users


def load(path: str | Path) -> WebConfig:
    """The configuration in ``path``, or WebConfigError with a one-line reason."""
    path = Path(path)
    document = _load_yaml(path)
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise WebConfigError(f"{path}: expected a mapping with tls_server_config, "
                             "basic_auth_users or http_server_config")
    unknown = sorted(set(document) - KNOWN_KEYS[""])
    if unknown:
        raise WebConfigError(f"{path}: unknown key {unknown[0]}")
    http = _section(document, "http_server_config", path)
    headers = http.get("headers") or {}
    if not isinstance(headers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and "\n" not in k + v
            for k, v in headers.items()):
        raise WebConfigError(f"{path}: http_server_config.headers must map names to strings")
    users = _users(document.get("basic_auth_users"), path)
    decoy = b""
    if users:
        import bcrypt

        decoy = bcrypt.hashpw(b"no such user", bcrypt.gensalt(10))
    return WebConfig(path=path, tls=_tls_context(_section(document, "tls_server_config", path),
                                                 path),
                     users=users, headers=dict(headers), decoy_hash=decoy)
