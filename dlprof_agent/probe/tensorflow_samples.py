"""How many samples a TensorFlow step took: the leading dimension of the step
function's arguments, or Keras's fit loop and its data adapter. Runs on the
training thread from the hooks (``tensorflow_hooks``); never raises past them.
Tensors, adapters and frames are TensorFlow's and Keras's objects (Any)."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any


def leading_dim(values: tuple[Any, ...]) -> int | None:
    """First known leading dimension among values, looking one level into
    tuples, lists and dicts (a step called with ``(x, y)``)."""
    for value in values:
        if isinstance(value, (tuple, list)):
            inner: Any = value[:4]
        elif isinstance(value, dict):
            inner = itertools.islice(value.values(), 4)
        else:
            inner = (value,)
        for item in inner:
            found = _shape_dim(item)
            if found is not None:
                return found
    return None


def _shape_dim(value: Any) -> int | None:
    shape = getattr(value, "shape", None)
    if shape is None:
        return None
    try:
        if len(shape) == 0:
            return None
        first = shape[0]
        first = None if first is None else int(first)
    except (TypeError, ValueError, IndexError):  # unknown rank
        return None
    return first if first is not None and first > 0 else None


@dataclass(frozen=True)
class FitShape:
    """What a fit's steps hold, read once a fit: the batch, the batches an epoch
    (None: unknown), the final partial batch (None: none), steps a call."""

    batch: int
    batches: int | None
    partial: int | None
    per_call: int
    fixed_steps: bool  # steps_per_epoch was given: the index says nothing of the data

    def samples(self, begin: int, end: int) -> int | None:
        """Samples of the steps ``begin`` to ``end`` of an epoch."""
        batch, batches, partial = self.batch, self.batches, self.partial
        if self.fixed_steps or batches is None:
            return batch * (end - begin + 1)
        if begin >= batches:
            return None
        last = min(end, batches - 1)
        samples = batch * (last - begin + 1)
        if partial is not None and last == batches - 1:
            samples -= batch - partial
        return samples


class KerasSamples:
    """The samples of a Keras step, read from the fit loop that called it.

    Reading a frame's locals builds a dict of them all, and run cold, after a
    step's compute, attribute reads of Keras's objects cost microseconds each. So a
    fit's locals, its data adapter and its epoch iterator are read at its first step
    (``of_caller``); each later step only reads the epoch iterator's count of the
    steps it handed out (``count``, whose last ``per_call`` are the step's), and its
    samples are worked out from that count off the job's path (``of_count``)."""

    def __init__(self) -> None:
        # The fit frame's id and its epoch iterator, where its count agreed.
        self._fit: tuple[int, weakref.ref[Any]] | None = None
        self.shape: FitShape | None = None  # the latest fit's, for of_count
        self._adapter: weakref.ref[Any] | None = None  # whose properties made shape

    def forget(self) -> None:
        self._fit = None
        self.shape = None
        self._adapter = None

    def count(self, caller: FrameType) -> int | None:
        """The epoch iterator's count at this step, where ``caller`` is the fit whose
        first step ``of_caller`` read; None: read it with ``of_caller``."""
        fit = self._fit
        # A frame's id is reused once it is gone; its epoch iterator is gone too.
        iterator = fit[1]() if fit is not None and fit[0] == id(caller) else None
        seen = getattr(iterator, "_steps_seen", None)
        return seen if type(seen) is int else None

    def of_count(self, count: int) -> int | None:
        """The samples of the step at which the epoch iterator's count was ``count``."""
        shape = self.shape
        if shape is None or count < shape.per_call:
            return None
        begin = count - shape.per_call
        return shape.samples(begin, begin + shape.per_call - 1)

    def of_caller(self, caller: FrameType) -> int | None:
        name = caller.f_code.co_name
        if name == "fit":
            names = caller.f_locals
            begin, end = names.get("begin_step"), names.get("end_step")
            if isinstance(begin, int) and isinstance(end, int):
                iterator = names.get("epoch_iterator")
                self._fit = None
                adapter = getattr(iterator, "data_adapter", None)
                if self._adapter is None or self._adapter() is not adapter:
                    self.shape, self._adapter = _fit_shape(iterator, adapter), None
                    with contextlib.suppress(TypeError):  # no weak references to it
                        self._adapter = weakref.ref(adapter)
                if self.shape is None:
                    return None
                if _begin_step(iterator) == begin:
                    with contextlib.suppress(TypeError):  # no weak references to it
                        self._fit = (id(caller), weakref.ref(iterator))
                return self.shape.samples(begin, end)
        elif name == "train_on_batch":
            return leading_dim((caller.f_locals.get("x"),))
        return None


def _fit_shape(epoch_iterator: Any, adapter: Any) -> FitShape | None:
    if adapter is None:
        return None
    # Properties of some adapters run TensorFlow ops: read them once a fit, on the
    # job's thread.
    batch, batches, partial = adapter.batch_size, adapter.num_batches, None
    if adapter.has_partial_batch:
        partial = adapter.partial_batch_size
    batch = _positive(batch)
    per_call = getattr(epoch_iterator, "steps_per_execution", 1)
    if batch is None or type(per_call) is not int or per_call < 1:
        return None
    return FitShape(batch, _positive(batches), _positive(partial), per_call,
                    bool(getattr(epoch_iterator, "steps_per_epoch", None)))


def _begin_step(epoch_iterator: Any) -> int | None:
    """The first step of the one the epoch iterator last handed out, from its count."""
    seen = getattr(epoch_iterator, "_steps_seen", None)
    per_call = getattr(epoch_iterator, "steps_per_execution", None)
    if type(seen) is int and type(per_call) is int and per_call > 0 and seen >= per_call:
        return seen - per_call
    return None


def _positive(value: Any) -> int | None:
    if isinstance(value, int) and value > 0:
        return value
    return None
