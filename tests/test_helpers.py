"""wait_until: the predicate's truthy value comes back, an OSError counts as not
yet, and a timeout says what was awaited."""

from __future__ import annotations

import itertools

import pytest

from tests.helpers import wait_until


def test_it_returns_the_first_truthy_value() -> None:
    answers = iter([None, 0, "", "ready"])
    assert wait_until(lambda: next(answers), 5, interval=0) == "ready"


def test_an_oserror_counts_as_not_yet() -> None:
    calls = itertools.count()

    def refused_twice() -> int:
        if next(calls) < 2:
            raise ConnectionRefusedError("not listening yet")
        return 7

    assert wait_until(refused_twice, 5, interval=0) == 7


def test_a_timeout_names_what_was_awaited_and_the_last_answer() -> None:
    with pytest.raises(AssertionError, match=r"timed out after 0 s waiting for the "
                                             r"server \(last: False\)"):
        wait_until(lambda: False, 0, what="the server")
    with pytest.raises(AssertionError, match=r"lambda: \[\]"):  # a lambda by its source
        wait_until(lambda: [], 0)


def test_other_errors_are_not_swallowed() -> None:
    def broken() -> bool:
        raise KeyError("a bug in the test")

    with pytest.raises(KeyError):
        wait_until(broken, 5)
