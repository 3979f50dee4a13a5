"""A reply's open-ended rows (layers, kernels, layer GPU times) cut to what the
series budget can keep, before any per-row object is built.

Why: a tenant chooses how many rows it sends, and building, checking and
hashing a typed object per row cost the daemon 2-3 us a row: 17-24 ms for a
reply of 4,096 layers of 510-character names and 4,000 kernels, then 6-7 ms to
fold most of them into ``other`` (``series_budget``). Here each family's
columns are checked whole with builtins that loop in C (``map``, ``min``,
``sum``); the families share the budget as the fold shares it (``share``);
the rows are ranked by time and only those that fit the family's share are
built; the rest are summed into the family's ``other`` row (per device for
kernels, per phase for layer GPU rows), as the fold would have done: 10 ms for
that reply, and the fold that follows keeps the same rows. A job whose rows fit
the budget (a ResNet-50 with layers and kernels: a few hundred rows) is
returned as sent.

Every value is still checked, kept or not: a malformed reply is refused whole
(ProtocolError), as before.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

from dlprof_agent.errors import ProtocolError
from dlprof_agent.probe.messages import OTHER

# The longest name a reply may carry (a layer's dotted path, a kernel's short name, a
# setting): a probe of ours sends none longer; samples.py refuses a reply that does.
MAX_NAME_CHARS = 512
ROW_NUMBER_BYTES = 12  # about what one number and its comma take in the reply's JSON


class Trimmed(NamedTuple):
    rows: list[list[object]]  # the rows kept, in their order, then the other rows
    folded_series: int  # series the rows left out would have rendered, less the other rows'
    row_bytes: int  # about what the rows took in the reply, kept or not


def _malformed(what: str) -> ProtocolError:
    return ProtocolError("malformed", f"the reply's {what} is not what a probe sends")


def _columns(rows: Sequence[object], width: int, what: str) -> list[tuple[Any, ...]]:
    """The rows' columns, once each row is a list of ``width`` values."""
    if not all(type(row) is list and len(row) == width for row in rows):
        raise _malformed(what)
    if not rows:
        return [() for _ in range(width)]
    return list(zip(*rows, strict=True))


def _names(column: Sequence[Any], what: str) -> int:
    """The column's characters; every name a string, an int or a float."""
    if not set(map(type, column)) <= {str}:
        if not set(map(type, column)) <= {str, int, float}:
            raise _malformed(what)
        column = [str(value) for value in column]
    longest = max(map(len, column), default=0)
    if longest > MAX_NAME_CHARS:
        raise ProtocolError("oversized", f"a {what} of {longest} characters")
    return sum(map(len, column))


def _counts(column: Sequence[Any], what: str) -> None:
    if not set(map(type, column)) <= {int} or (
            column and not 0 <= min(column) <= max(column) < 1 << 63):
        raise _malformed(what)


def _seconds(column: Sequence[Any], what: str) -> None:
    # NaN and infinities make the sum non-finite; a negative value makes the minimum so.
    if not set(map(type, column)) <= {int, float} or (column and (
            min(column) < 0 or not math.isfinite(sum(column)))):
        raise _malformed(what)


def _ranked(seconds: Sequence[float], costs: Sequence[int], names: Sequence[object],
            budget: int, other_cost: int) -> list[int]:
    """The rows kept, as their indices in order: the longest first while they fit
    the budget with room for the other rows. A row named ``other`` is never kept:
    it folds in with the rest."""
    order = sorted((i for i in range(len(seconds)) if names[i] != OTHER),
                   key=seconds.__getitem__, reverse=True)
    kept, used = [], other_cost
    for index in order:
        if used + costs[index] > budget:
            break
        kept.append(index)
        used += costs[index]
    return sorted(kept)


def share(wants: Sequence[int], total: int) -> list[int]:
    """Split ``total`` among ``wants``: each gets what it wants up to one level,
    the same for all, the highest level that fits (max-min fairness). A tenant
    with few series keeps them all; only the widest are cut."""
    if sum(wants) <= total:
        return list(wants)
    grants = [0] * len(wants)
    left, waiting = max(0, total), sorted(range(len(wants)), key=lambda i: wants[i])
    while waiting:
        level = left // len(waiting)
        index = waiting[0]
        if wants[index] > level:
            for i in waiting:
                grants[i] = level
            break
        grants[index] = wants[index]
        left -= wants[index]
        waiting.pop(0)
    return grants


def family_budgets(max_series: int | None, wants: Sequence[int]) -> list[int | None]:
    """What each family may keep of ``max_series`` (None: all), shared between
    them as the budget's fold shares it: no family is cut below what the fold
    would keep of it."""
    return [None] * len(wants) if max_series is None else list(share(wants, max_series))


def layer_series(rows: Sequence[object]) -> int:
    """The series layer rows would render, or an upper bound if they are not
    well formed (trim_layers then refuses them)."""
    total = 0
    try:
        for row in cast(Sequence[Sequence[Any]], rows):
            total += _layer_cost(row[2], row[4])
    except (TypeError, IndexError, KeyError):
        return 4 * len(rows)
    return total


def _layer_cost(forward_calls: int, backward_calls: int) -> int:
    return 2 * ((forward_calls > 0) + (backward_calls > 0))


def trim_layers(rows: Sequence[object], budget: int | None) -> Trimmed:
    """Layer rows [name, forward s, forward calls, backward s, backward calls]."""
    names, forward, forward_calls, backward, backward_calls = _columns(rows, 5, "layers")
    row_bytes = _names(names, "layer name") + 4 * ROW_NUMBER_BYTES * len(names)
    for column in (forward, backward):
        _seconds(column, "layer seconds")
    for column in (forward_calls, backward_calls):
        _counts(column, "layer calls")
    listed = cast(list[list[Any]], list(rows))  # lists, checked above
    costs = list(map(_layer_cost, forward_calls, backward_calls))
    if budget is None or sum(costs) <= budget:
        return Trimmed(listed, 0, row_bytes)
    seconds = list(map(operator.add, forward, backward))
    kept = _ranked(seconds, costs, names, budget, other_cost=4)
    rest = sorted(set(range(len(listed))) - set(kept))
    other = [OTHER, *(sum(column[i] for i in rest)
                      for column in (forward, forward_calls, backward, backward_calls))]
    folded = (sum(costs[i] for i in rest)
              - _layer_cost(other[2], other[4]))
    return Trimmed([listed[i] for i in kept] + [other],
                   folded, row_bytes)


def trim_kernels(rows: Sequence[object], budget: int | None) -> Trimmed:
    """Kernel rows [name, device, launches, seconds]; two series each."""
    names, devices, launches, seconds = _columns(rows, 4, "kernel rows")
    row_bytes = _names(names, "kernel name") + 3 * ROW_NUMBER_BYTES * len(names)
    _counts(devices, "device")
    _counts(launches, "launches")
    _seconds(seconds, "kernel seconds")
    listed = cast(list[list[Any]], list(rows))  # lists, checked above
    if budget is None or 2 * len(listed) <= budget:
        return Trimmed(listed, 0, row_bytes)
    kept = _ranked(seconds, [2] * len(listed), names,
                   budget, other_cost=2 * len(set(devices)))
    others = _others(listed, kept, group=1, sums=(2, 3))
    return Trimmed([listed[i] for i in kept] + others,
                   2 * (len(listed) - len(kept) - len(others)), row_bytes)


def trim_layer_gpu(rows: Sequence[object], budget: int | None) -> Trimmed:
    """Layer GPU rows [layer, phase, seconds]; one series each."""
    names, phases, seconds = _columns(rows, 3, "layer GPU rows")
    row_bytes = (_names(names, "layer name") + _names(phases, "phase")
                 + ROW_NUMBER_BYTES * len(names))
    _seconds(seconds, "layer GPU seconds")
    listed = cast(list[list[Any]], list(rows))  # lists, checked above
    if budget is None or len(listed) <= budget:
        return Trimmed(listed, 0, row_bytes)
    kept = _ranked(seconds, [1] * len(listed), names,
                   budget, other_cost=len(set(phases)))
    others = _others(listed, kept, group=1, sums=(2,))
    return Trimmed([listed[i] for i in kept] + others,
                   len(listed) - len(kept) - len(others), row_bytes)


def _others(rows: list[list[Any]], kept: list[int], *, group: int,
            sums: tuple[int, ...]) -> list[list[object]]:
    """One ``other`` row per value of column ``group`` among the rows not kept,
    columns ``sums`` summed, in the order the groups first appear."""
    kept_set = set(kept)
    groups: dict[object, list[list[Any]]] = {}
    for index, row in enumerate(rows):
        if index not in kept_set:
            groups.setdefault(row[group], []).append(row)
    return [[OTHER, *(sum(row[column] for row in members)
                      if column in sums else members[0][column]
                      for column in range(1, len(members[0])))]
            for members in groups.values()]
