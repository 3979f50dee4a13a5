"""Where a PyTorch model's batch and output tensors are: positional or keyword
inputs, tuples, lists and dicts of tensors (a ``BatchEncoding``, a
``ModelOutput``). Tensors and nodes are torch's objects (Any); nothing here
imports torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def first_tensor(values: Any, tensor_type: type) -> Any:
    if isinstance(values, tensor_type):
        return values
    if isinstance(values, Mapping):  # a dict of inputs, a BatchEncoding, a ModelOutput
        values = values.values()
    elif not isinstance(values, (tuple, list)):
        return None
    for value in values:
        if isinstance(value, tensor_type):
            return value
    return None


def batch_tensor(args: Any, kwargs: Any, tensor_type: type) -> Any:
    """The model's first tensor input with a batch dimension: positional, in a
    dict passed positionally, or keyword."""
    for values in (args, args[0] if args else None, kwargs):
        tensor = first_tensor(values, tensor_type)
        if tensor is not None and tensor.dim() > 0:
            return tensor
    return None


def batch_dimension(root: Any, rnn_type: type) -> int:
    """Where the batch is in the model's input: 1 for a sequence-first recurrent
    model (an ``nn.RNN``/``LSTM``/``GRU`` left at ``batch_first=False``, as in
    pytorch/examples' word_language_model, whose input is (sequence, batch)),
    else 0."""
    for module in root.modules():
        if isinstance(module, rnn_type):
            return 0 if getattr(module, "batch_first", True) else 1
    return 0


def output_node(output: Any, tensor_type: type) -> Any:
    """The autograd node of the model's first output that has one."""
    node = getattr(output, "grad_fn", None)
    if node is not None:
        return node
    values: Any = output
    if isinstance(output, Mapping):
        values = output.values()
    elif not isinstance(output, (tuple, list)):
        return None
    for value in values:
        node = getattr(value, "grad_fn", None) if isinstance(value, tensor_type) else None
        if node is not None:
            return node
    return None
