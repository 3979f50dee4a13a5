"""Metrics as `top` reads them: the samples of the agent's own collector, or of
any agent's or daemon's /metrics fetched over HTTP(S) and parsed with
prometheus_client's parser, as one plain value (``Readings``) that the screen
reads without knowing where it came from."""

from __future__ import annotations

import base64
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dlprof_agent.errors import DlprofError, ExitCode

FETCH_SECONDS = 5.0
MAX_BODY_BYTES = 64 << 20  # a daemon at its 50,000-series budget serves a few MiB


class MetricsUnreachable(DlprofError):
    """An agent's /metrics could not be read: unreachable, refused, or not an agent."""

    exit_code = ExitCode.NO_TARGET


Labels = Mapping[str, str]


@dataclass(frozen=True)
class Readings:
    """One read of the metrics: each sample name (``_total``, ``_bucket`` kept)
    with its series, as (labels, value)."""

    series: Mapping[str, tuple[tuple[Labels, float], ...]]

    @classmethod
    def of_families(cls, families: Iterable[Any]) -> Readings:
        """From prometheus_client metric families, collected or parsed."""
        series: dict[str, list[tuple[Labels, float]]] = {}
        for family in families:
            for sample in family.samples:
                series.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
        return cls({name: tuple(rows) for name, rows in series.items()})

    @classmethod
    def of_text(cls, text: str) -> Readings:
        """From the text exposition format that /metrics serves."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            return cls.of_families(text_string_to_metric_families(text))
        except ValueError as error:
            raise MetricsUnreachable(f"its /metrics is not in Prometheus's text format "
                                     f"({str(error)[:80]})") from None

    def rows(self, name: str, **labels: str) -> tuple[tuple[Labels, float], ...]:
        """The series of ``name`` whose labels include ``labels``."""
        return tuple((have, value) for have, value in self.series.get(name, ())
                     if all(have.get(key) == wanted for key, wanted in labels.items()))

    def value(self, name: str, **labels: str) -> float | None:
        """The sum over the series of ``name`` that match; None when none does."""
        rows = self.rows(name, **labels)
        return sum(value for _, value in rows) if rows else None


def collected(collector: Any) -> Readings:
    """What ``collector`` (a prometheus_client collector: NodeCollector) yields now:
    the families a scrape would render, without rendering them."""
    return Readings.of_families(collector.collect())


@dataclass(frozen=True)
class MetricsUrl:
    """Where an agent serves, and how to be let in: --web.config.file's basic
    auth and TLS, as a scraper would present them."""

    url: str
    user: str | None = None
    password: str | None = None
    ca_file: str | None = None  # a CA that signed the agent's certificate
    insecure: bool = False  # take any certificate (a self-signed one on a test node)

    def metrics_url(self) -> str:
        base = self.url.rstrip("/")
        return base if base.endswith("/metrics") else base + "/metrics"

    def _context(self) -> ssl.SSLContext | None:
        if not self.metrics_url().startswith("https://"):
            return None
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context

    def read(self, timeout: float = FETCH_SECONDS) -> Readings:
        """One scrape, parsed. Raises MetricsUnreachable with one line on failure."""
        url = self.metrics_url()
        request = urllib.request.Request(url, headers={"Accept": "text/plain"})
        if self.user is not None:
            token = base64.b64encode(f"{self.user}:{self.password or ''}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout,
                                        context=self._context()) as response:
                body = response.read(MAX_BODY_BYTES + 1)
        except urllib.error.HTTPError as error:
            hint = ("give --user and the password (DLPROF_PASSWORD or --password-file)"
                    if error.code == 401 else "")
            raise MetricsUnreachable(f"{url} refused: HTTP {error.code} {error.reason}",
                                     hint) from None
        except urllib.error.URLError as error:
            reason = error.reason
            if isinstance(reason, ssl.SSLCertVerificationError):
                raise MetricsUnreachable(
                    f"{url}: its TLS certificate is not trusted ({reason.verify_message})",
                    "give --ca-file with the CA that signed it, or --insecure") from None
            why = reason.strerror if isinstance(reason, OSError) and reason.strerror \
                else str(reason)
            raise MetricsUnreachable(f"cannot reach {url} ({why})",
                                     "is an agent or daemon serving there?") from None
        except TimeoutError:
            raise MetricsUnreachable(f"{url} did not answer within {timeout:g} s") from None
        except (OSError, ValueError) as error:  # a reset, a bad URL, a plain-HTTP server
            raise MetricsUnreachable(f"cannot read {url} ({error})") from None
        if len(body) > MAX_BODY_BYTES:
            raise MetricsUnreachable(f"{url} served more than {MAX_BODY_BYTES >> 20} MiB")
        readings = Readings.of_text(body.decode("utf-8", errors="replace"))
        if "dlprof_agent_info" not in readings.series:
            raise MetricsUnreachable(f"{url} serves no dlprof-agent metrics",
                                     "point --url at an agent's or daemon's port (9945)")
        return readings
