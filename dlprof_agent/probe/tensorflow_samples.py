"""How many samples a TensorFlow step took: the leading dimension of the step
function's arguments, or Keras's fit loop and its data adapter. Runs on the
training thread from the hooks (``tensorflow_hooks``); never raises past them.
Tensors, adapters and frames are TensorFlow's and Keras's objects (Any)."""

from __future__ import annotations

import itertools
import weakref
from types import FrameType
from typing import Any

# A weak reference to a data adapter, its batch size, batches per epoch and
# final partial batch size.
_AdapterCache = tuple[weakref.ref[Any], int | None, int | None, int | None]


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


class KerasSamples:
    """The samples of a Keras step, read from the fit loop that called it."""

    def __init__(self) -> None:
        self._adapter_cache: _AdapterCache | None = None

    def forget(self) -> None:
        self._adapter_cache = None

    def of_caller(self, caller: FrameType) -> int | None:
        name = caller.f_code.co_name
        if name == "fit":
            names = caller.f_locals
            begin, end = names.get("begin_step"), names.get("end_step")
            if isinstance(begin, int) and isinstance(end, int):
                return self._epoch_samples(names.get("epoch_iterator"), begin, end)
        elif name == "train_on_batch":
            return leading_dim((caller.f_locals.get("x"),))
        return None

    def _epoch_samples(self, epoch_iterator: Any, begin: int, end: int) -> int | None:
        adapter = getattr(epoch_iterator, "data_adapter", None)
        if adapter is None:
            return None
        cache = self._adapter_cache
        if cache is None or cache[0]() is not adapter:
            # Properties of some adapters run TensorFlow ops: read them once per fit.
            batch, batches, partial = adapter.batch_size, adapter.num_batches, None
            if adapter.has_partial_batch:
                partial = adapter.partial_batch_size
            cache = (weakref.ref(adapter), _positive(batch), _positive(batches),
                     _positive(partial))
            self._adapter_cache = cache
        _, batch, batches, partial = cache
        if batch is None:
            return None
        if getattr(epoch_iterator, "steps_per_epoch", None) or batches is None:
            # The step index says nothing about where in the data the step is.
            return batch * (end - begin + 1)
        if begin >= batches:
            return None
        last = min(end, batches - 1)
        samples = batch * (last - begin + 1)
        if partial is not None and last == batches - 1:
            samples -= batch - partial
        return samples

def _positive(value: Any) -> int | None:
    if isinstance(value, int) and value > 0:
        return value
    return None
