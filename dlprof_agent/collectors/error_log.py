"""Counts collector failures and logs each distinct one once."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable

log = logging.getLogger("dlprof_agent")


class ErrorLog:
    """Failures per collector, for ``dlprof_collector_errors_total``.

    A failure that repeats every interval is logged the first time only, so a
    lost GPU or a denied file does not flood the terminal.
    """

    def __init__(self, collectors: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        # Known collectors start at 0, so a rate() over them exists before any failure.
        self._counts: Counter[str] = Counter(dict.fromkeys(collectors, 0))
        self._logged: set[tuple[str, str]] = set()

    def record(self, collector: str, error: BaseException | str) -> None:
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        with self._lock:
            self._counts[collector] += 1
            first_time = (collector, message) not in self._logged
            self._logged.add((collector, message))
        if first_time:
            log.warning("%s collector: %s (counted in dlprof_collector_errors_total)",
                        collector, message)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
