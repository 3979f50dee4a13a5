"""The trainers tier's window: where the job's own timer places the probe's
steps. A long step on the window's edge (an epoch's turn in Keras fit) is
counted by the probe or not depending on where its hook closes a step; the
job's figure must allow both, and no more."""

from __future__ import annotations

import math

import pytest

from tests.test_trainers import job_window, outside

STEP = 0.004
STALL = 0.5


def keras_like_log(stall_at: int) -> list[dict[str, object]]:
    """100 steps of 4 ms, one of them 0.5 s; the probe closes a step at each
    train_function's start, so its count at a step's end is that step's index."""
    log: list[dict[str, object]] = [{"pid": 1, "batch": 16}]
    end = 100.0
    for step in range(100):
        end += STALL if step == stall_at else STEP
        log.append({"step": step, "end": end, "probe_steps": step})
    return log


def probe_seconds(first: int, last: int, stall_at: int) -> float:
    """The probe's steps first+1..last: from the start of step `first` to the
    start of step `last`, so they hold the executions of steps first..last-1."""
    return sum(STALL if step == stall_at else STEP for step in range(first, last))


@pytest.mark.parametrize("stall_at", [10, 40, 70], ids=["at-start", "inside", "at-end"])
def test_the_probes_window_lies_within_the_jobs_bounds_wherever_a_long_step_falls(
        stall_at: int) -> None:
    shortest, longest = job_window(keras_like_log(stall_at), 10, 70)
    assert outside(probe_seconds(10, 70, stall_at), (shortest, longest)) == 0.0


def test_the_bounds_are_one_step_wide_on_each_edge_without_a_long_step() -> None:
    shortest, longest = job_window(keras_like_log(-1), 10, 70)
    assert math.isclose(shortest, 59 * STEP) and math.isclose(longest, 61 * STEP)


def test_a_window_one_stall_too_long_is_outside_the_bounds() -> None:
    shortest, longest = job_window(keras_like_log(40), 10, 70)
    assert outside(probe_seconds(10, 70, 40) + STALL, (shortest, longest)) > 0.5
