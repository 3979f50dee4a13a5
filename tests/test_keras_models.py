"""The Keras reference models: every model of MODELS builds with exactly the
trainable-parameter count of its PyTorch twin, trains a step, and reads well;
the NCHW builds compute what the NHWC ones do."""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
pytest.importorskip("tensorflow")

import keras
import numpy as np

from dlprof_agent.workloads import keras_models
from dlprof_agent.workloads.models import MODELS

pytestmark = pytest.mark.slow  # it imports TensorFlow

REPO = Path(__file__).resolve().parents[1]

# The same exact counts as tests/test_torch_models.py. Dense: in * out + out; conv:
# k * k * in * out (+ out with a bias); batch norm: gamma and beta per channel.
TRAINABLE = {
    # 26752*2048+2048 + 3*(2048*2048+2048) + 2048*26752+26752
    "fcn-s": 122_194_048,
    # 784*2048+2048 + 2048*4096+4096 + 4096*1024+1024 + 1024*10+10
    "fcn-r": 14_205_962,
    # convs 34,944 + 614,656 + 885,120 + 1,327,488 + 884,992; fc 6*6*256*4096+4096,
    # 4096*4096+4096, 4096*1000+1000
    "alexnet-s": 62_378_344,
    # convs 2,432 + 25,632 + 51,264; fc 1024*10+10
    "alexnet-r": 89_578,
    "resnet-50": 25_557_032,  # torchvision's figure
    # stem 432+32; stage 1: 9*(2*2,304+64); stage 2: 13,952 + 8*18,560;
    # stage 3: 55,552 + 8*73,984; fc 650
    "resnet-56": 853_018,
    # embedding 10000*500; per LSTM 4*(500*500 + 500*500 + 500); fc 500*10000+10000
    "lstm": 14_014_000,
    # convs 448 + 4,640; fc 2048*64+64, 64*10+10
    "small-cnn": 136_874,
}
# Batch-norm moving means and variances, PyTorch's running-stat buffers: 2 per channel.
NON_TRAINABLE = {"resnet-50": 53_120, "resnet-56": 2 * (16 + 9 * 2 * (16 + 32 + 64))}
IMAGE_MODELS = [name for name, spec in MODELS.items() if spec.kind == "image"]
BATCH = 2
nchw = pytest.mark.skipif(not keras_models.nchw_trains_here(),
                          reason="TensorFlow cannot run NCHW convolutions here")


@functools.cache
def built(name: str, data_format: str = "channels_last") -> Any:
    """One build per model and layout for the whole module: the large ones take seconds."""
    return keras_models.build(name, data_format=data_format)


def output_shape(name: str, batch: int) -> tuple[int, ...]:
    spec = MODELS[name]
    if spec.kind == "sequence":
        return (batch, *spec.input_shape, spec.classes)
    return (batch, spec.classes)


def train_one_step(model: Any, name: str, data_format: str = "channels_last") -> float:
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras_models.loss(name))
    inputs, targets = keras_models.example_batch(name, BATCH, data_format=data_format)
    return float(model.train_on_batch(inputs, targets))


def test_every_registered_model_has_an_expected_count() -> None:
    assert set(TRAINABLE) == set(MODELS)


@pytest.mark.parametrize("name", list(TRAINABLE))
def test_trainable_parameters(name: str) -> None:
    model = built(name)
    assert keras_models.trainable_parameters(model) == TRAINABLE[name]
    non_trainable = sum(int(np.prod(w.shape)) for w in model.non_trainable_weights)
    assert non_trainable == NON_TRAINABLE.get(name, 0)


@pytest.mark.parametrize("name", list(TRAINABLE))
def test_one_training_step(name: str) -> None:
    model = built(name)
    last_before = model.trainable_weights[-1].numpy().copy()  # the logits' bias
    loss = train_one_step(model, name)
    assert math.isfinite(loss)
    assert not np.array_equal(last_before, model.trainable_weights[-1].numpy())

    inputs, _ = keras_models.example_batch(name, BATCH)
    outputs = keras.ops.convert_to_numpy(model(inputs, training=False))
    assert outputs.shape == output_shape(name, BATCH)
    assert np.isfinite(outputs).all()


@pytest.mark.parametrize("name", list(TRAINABLE))
def test_layers_have_names_chosen_for_them(name: str) -> None:
    # Keras names an unnamed layer after its class and numbers the repeats
    # ("conv2d_3"), so only chosen names survive a second build unchanged.
    first = [layer.name for layer in built(name).layers]
    again = [layer.name for layer in keras_models.build(name).layers]
    assert first == again
    for layer_name in first:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", layer_name), layer_name


def test_resnet_layer_names_say_where_they_are() -> None:
    names = {layer.name for layer in built("resnet-50").layers}
    assert {"stem_conv", "stage1_block1_proj_conv", "stage2_block1_conv2_pad",
            "stage4_block3_out", "global_pool", "logits"} <= names
    assert "stage2_block2_proj_conv" not in names  # projections on first blocks only
    names = {layer.name for layer in built("resnet-56").layers}
    assert {"stage2_block1_shortcut", "stage3_block1_shortcut"} <= names
    assert "stage1_block1_shortcut" not in names  # identity: nothing to subsample


def test_resnet_50_convolutions_have_no_bias() -> None:
    convs = [layer for layer in built("resnet-50").layers
             if isinstance(layer, keras.layers.Conv2D)]
    assert len(convs) == 1 + 16 * 3 + 4  # stem, 16 bottlenecks, 4 projections
    assert not any(conv.use_bias for conv in convs)


def test_option_a_shortcut_subsamples_and_zero_pads_channels() -> None:
    layer = keras_models.SubsampleZeroPad(4)
    inputs = np.arange(2 * 4 * 4 * 2, dtype=np.float32).reshape(2, 4, 4, 2)
    outputs = keras.ops.convert_to_numpy(layer(inputs))
    assert outputs.shape == (2, 2, 2, 6)
    np.testing.assert_array_equal(outputs[..., 2:4], inputs[:, ::2, ::2, :])
    assert not outputs[..., :2].any() and not outputs[..., 4:].any()
    assert not layer.weights
    assert layer.compute_output_shape((None, 5, 5, 2)) == (None, 3, 3, 6)


@pytest.mark.parametrize("name", list(TRAINABLE))
def test_example_batch_shapes_and_seed(name: str) -> None:
    spec = MODELS[name]
    inputs, targets = keras_models.example_batch(name, 3)
    assert inputs.shape == (3, *spec.input_shape)  # NHWC for images
    if spec.kind == "sequence":
        assert inputs.dtype == np.int32
        assert targets.shape == inputs.shape
        assert inputs.min() >= 0 and inputs.max() < spec.classes
    else:
        assert inputs.dtype == np.float32
        assert targets.shape == (3,)
    assert targets.dtype == np.int32
    assert targets.min() >= 0 and targets.max() < spec.classes

    again, _ = keras_models.example_batch(name, 3)
    np.testing.assert_array_equal(inputs, again)
    other, _ = keras_models.example_batch(name, 3, seed=1)
    assert not np.array_equal(inputs, other)

    first, _ = keras_models.example_batch(name, 3, data_format="channels_first")
    if spec.kind == "image":
        height, width, channels = spec.input_shape
        assert first.shape == (3, channels, height, width)
    else:  # nothing to lay out
        np.testing.assert_array_equal(first, inputs)


def test_loss_takes_logits_and_class_ids() -> None:
    for name in MODELS:
        loss = keras_models.loss(name)
        assert isinstance(loss, keras.losses.SparseCategoricalCrossentropy)
        assert loss.get_config()["from_logits"]


@nchw
@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_nchw_builds_have_the_same_parameters(name: str) -> None:
    model = built(name, "channels_first")
    assert model.input_shape[1] == MODELS[name].input_shape[-1]  # channels first
    assert keras_models.trainable_parameters(model) == TRAINABLE[name]


@nchw
@pytest.mark.parametrize("name", ["small-cnn", "alexnet-r", "resnet-56"])
def test_nchw_computes_what_nhwc_does(name: str) -> None:
    # The same weights fit both layouts: kernels are (k, k, in, out) either way and
    # Flatten reorders NCHW features as NHWC ones. Nonzero biases: alexnet-r's first
    # convolution has as many channels as columns, which Keras's own bias add confuses.
    nhwc, nchw_model = built(name), built(name, "channels_first")
    rng = np.random.default_rng(0)
    for weight in nhwc.trainable_weights:
        weight.assign(weight.numpy() + rng.normal(0.0, 0.01, weight.shape).astype(np.float32))
    nchw_model.set_weights(nhwc.get_weights())
    inputs, _ = keras_models.example_batch(name, BATCH)
    expected = keras.ops.convert_to_numpy(nhwc(inputs, training=False))
    actual = nchw_model(np.ascontiguousarray(inputs.transpose(0, 3, 1, 2)), training=False)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(actual), expected,
                               rtol=1e-4, atol=1e-4)


@nchw
@pytest.mark.parametrize("name", ["small-cnn", "alexnet-r"])
def test_nchw_trains(name: str) -> None:
    assert math.isfinite(train_one_step(built(name, "channels_first"), name,
                                        "channels_first"))


def test_nchw_without_a_kernel_for_it_fails_at_build_time() -> None:
    # With oneDNN off, TensorFlow's CPU convolutions are NHWC only: build() says
    # so, instead of the first step failing in a kernel.
    script = (
        "from dlprof_agent.workloads import keras_models as k\n"
        "assert not k.nchw_trains_here()\n"
        "k.build('lstm', data_format='channels_first')\n"  # no layout: fine
        "try:\n"
        "    k.build('small-cnn', data_format='channels_first')\n"
        "except ValueError as e:\n"
        "    print(e)\n")
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "0", "CUDA_VISIBLE_DEVICES": "-1",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "NCHW) needs a GPU on TensorFlow" in result.stdout


@pytest.mark.parametrize("call", [
    lambda: keras_models.build("vgg-16"),
    lambda: keras_models.example_batch("vgg-16", 1),
    lambda: keras_models.loss("vgg-16"),
])
def test_unknown_name_lists_the_known_ones(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError, match="vgg-16") as error:
        call()
    for name in MODELS:
        assert name in str(error.value)


@pytest.mark.parametrize("call", [
    lambda: keras_models.build("small-cnn", data_format="NCHW"),
    lambda: keras_models.example_batch("small-cnn", 1, data_format="NCHW"),
])
def test_unknown_data_format(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError, match="channels_last, channels_first"):
        call()
