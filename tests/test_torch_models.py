"""The PyTorch reference models: every model of MODELS builds with the expected
number of trainable parameters (the Keras builds must match it) and trains."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

pytest.importorskip("torch")

import torch
from torch import nn

from dlprof_agent.workloads import torch_models
from dlprof_agent.workloads.models import MODELS

pytestmark = pytest.mark.slow  # it imports torch

# Exact counts of the architectures in MODELS' descriptions, next to the papers' figures.
# fcn-s is twice the paper's ~55M: 26752 x 2048 weights at both ends are ~54.8M each.
TRAINABLE = {
    "fcn-s": 122_194_048,  # paper ~55M
    "fcn-r": 14_205_962,  # paper ~13M
    "alexnet-s": 62_378_344,  # paper ~61M (torchvision's 64-filter AlexNet has 61.1M)
    "alexnet-r": 89_578,  # paper ~81K
    "resnet-50": 25_557_032,  # paper ~25.6M, the same as torchvision's
    "resnet-56": 853_018,  # paper ~0.85M
    "lstm": 14_014_000,  # paper ~13M; b_hh (4000) is frozen
    "small-cnn": 136_874,
}

BATCH = 2


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    torch.set_num_threads(2)


def test_every_registered_model_has_an_expected_count() -> None:
    assert set(TRAINABLE) == set(MODELS)


@pytest.mark.parametrize("name", list(TRAINABLE))
def test_trainable_parameters(name: str) -> None:
    with torch.device("meta"):  # shapes only: fcn-s would spend seconds initialising 122M
        model = torch_models.build(name)
    assert torch_models.trainable_parameters(model) == TRAINABLE[name]


@pytest.mark.parametrize("name", list(TRAINABLE))
def test_one_training_step(name: str) -> None:
    torch.manual_seed(0)
    spec = MODELS[name]
    model = torch_models.build(name)
    inputs, targets = torch_models.example_batch(name, BATCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainable = [p for p in model.parameters() if p.requires_grad]
    last_before = trainable[-1].detach().clone()  # the output layer's: every loss reaches it

    outputs = model(inputs)
    expected = (BATCH, *spec.input_shape, spec.classes) if spec.kind == "sequence" else (
        BATCH, spec.classes)
    assert tuple(outputs.shape) == expected
    loss = torch_models.loss_fn(name)(outputs, targets)
    assert loss.dim() == 0
    assert math.isfinite(loss.item())
    optimizer.zero_grad()
    torch.autograd.backward(loss)  # Tensor.backward is untyped for mypy
    optimizer.step()

    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in trainable)
    assert not torch.equal(last_before, trainable[-1].detach())


@pytest.mark.parametrize("name", list(TRAINABLE))
def test_example_batch_shapes_and_seed(name: str) -> None:
    spec = MODELS[name]
    inputs, targets = torch_models.example_batch(name, 3)
    if spec.kind == "image":
        height, width, channels = spec.input_shape
        assert inputs.shape == (3, channels, height, width)  # NCHW
    else:
        assert inputs.shape == (3, *spec.input_shape)
    if spec.kind == "sequence":
        assert inputs.dtype == torch.int64
        assert targets.shape == inputs.shape
        assert int(inputs.min()) >= 0 and int(inputs.max()) < spec.classes
    else:
        assert inputs.dtype == torch.float32
        assert targets.shape == (3,)
    assert targets.dtype == torch.int64
    assert int(targets.min()) >= 0 and int(targets.max()) < spec.classes

    again, _ = torch_models.example_batch(name, 3)
    assert torch.equal(inputs, again)
    other, _ = torch_models.example_batch(
        name, 3, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(inputs, other)


def test_alexnet_layer_names_read_like_torchvision() -> None:
    model = torch_models.build("alexnet-s")
    names = dict(model.named_modules())
    assert isinstance(names["features.0"], nn.Conv2d)
    assert isinstance(names["classifier.0"], nn.Linear)
    assert isinstance(names["classifier.4"], nn.Linear)
    features = names["features"]
    assert features(torch.zeros(1, 3, 224, 224)).shape == (1, 256, 6, 6)


def test_alexnet_r_pools_to_4x4() -> None:
    model = torch_models.build("alexnet-r")
    assert isinstance(model, nn.Sequential)
    assert model[:-2](torch.zeros(1, 3, 32, 32)).shape == (1, 64, 4, 4)


def test_resnet_shortcuts() -> None:
    def convs(model: nn.Module) -> list[nn.Conv2d]:
        return [m for m in model.modules() if isinstance(m, nn.Conv2d)]

    # ResNet-50: stem + 16 bottlenecks x 3 + one projection per stage.
    with torch.device("meta"):
        resnet50 = convs(torch_models.build("resnet-50"))
        # ResNet-56: stem + 27 blocks x 2, and option A shortcuts add no convolution.
        resnet56 = convs(torch_models.build("resnet-56"))
    assert len(resnet50) == 1 + 16 * 3 + 4
    assert len(resnet56) == 1 + 27 * 2
    assert all(conv.bias is None for conv in resnet50 + resnet56)


def test_lstm_has_one_bias_per_gate() -> None:
    model = torch_models.build("lstm")
    frozen = {n: p for n, p in model.named_parameters() if "bias_hh" in n}
    assert set(frozen) == {"lstm.bias_hh_l0", "lstm.bias_hh_l1"}
    for parameter in frozen.values():
        assert not parameter.requires_grad
        assert not parameter.any()
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in frozen)

    inputs, targets = torch_models.example_batch("lstm", BATCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    torch.autograd.backward(torch_models.loss_fn("lstm")(model(inputs), targets))
    optimizer.step()
    assert not any(p.any() for p in frozen.values())


def test_small_cnn_is_the_existing_model() -> None:
    built = torch_models.build("small-cnn")
    reference = torch_models.small_cnn()
    assert [type(m) for m in built.modules()] == [type(m) for m in reference.modules()]


@pytest.mark.parametrize("call", [
    lambda: torch_models.build("vgg-16"),
    lambda: torch_models.example_batch("vgg-16", 1),
    lambda: torch_models.loss_fn("vgg-16"),
])
def test_unknown_name_lists_the_known_ones(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError, match="vgg-16") as error:
        call()
    for name in MODELS:
        assert name in str(error.value)
