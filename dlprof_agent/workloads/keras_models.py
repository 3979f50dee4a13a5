"""Keras builds of the reference models in `models.MODELS`.

Each build has exactly the trainable-parameter count of its PyTorch twin in
`torch_models`; where Keras and PyTorch pad differently, the layers below pad
explicitly so that the feature-map shapes match too. Weights keep Keras's
default initialisers: the workloads exist to be profiled, not to converge.

`data_format="channels_first"` lays the image models out NCHW instead of NHWC,
the layout lever the papers compare; the vector and sequence models have no
layout and ignore it. On the CPU, TensorFlow runs NCHW convolutions only with
its oneDNN kernels (its pooling Keras transposes to NHWC and back); where they
are off, `build` refuses NCHW rather than fail at the first step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import numpy.typing as npt
import tensorflow as tf

from dlprof_agent.workloads.models import MODELS, ModelSpec

DATA_FORMATS = ("channels_last", "channels_first")
# PyTorch's BatchNorm2d defaults: its momentum 0.1 weighs the new batch, Keras's
# momentum weighs the running average.
BN_EPSILON = 1e-5
BN_MOMENTUM = 0.9


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: "
                         f"{', '.join(MODELS)}") from None


def _check_data_format(data_format: str) -> None:
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format must be one of {', '.join(DATA_FORMATS)}, "
                         f"not {data_format!r}")


@functools.cache
def nchw_trains_here() -> bool:
    """Whether TensorFlow can train an NCHW convolution in this process. Its GPU
    kernels can; on the CPU only its oneDNN kernels can (on by default on x86
    Linux, off with TF_ENABLE_ONEDNN_OPTS=0): the plain ones support only NHWC."""
    if tf.config.list_physical_devices("GPU"):
        return True
    images, kernel = tf.zeros((1, 1, 3, 3)), tf.zeros((3, 3, 1, 1))
    try:
        with tf.GradientTape() as tape:
            tape.watch([images, kernel])
            outputs = tf.nn.conv2d(images, kernel, 1, "SAME", data_format="NCHW")
        tape.gradient(outputs, [images, kernel])
    except tf.errors.OpError:
        return False
    return True


def _image_shape(spec: ModelSpec, data_format: str) -> tuple[int, ...]:
    height, width, channels = spec.input_shape
    if data_format == "channels_first":
        return (channels, height, width)
    return (height, width, channels)


class ChannelBiasConv2D(keras.layers.Conv2D):  # type: ignore[misc]
    """`keras.layers.Conv2D` that adds an NCHW bias along the channels whatever
    the shape. Keras 3's TensorFlow `ops.add`, which Conv2D adds its bias with,
    becomes `bias_add` in NHWC whenever the last axis is as long as the bias: an
    NCHW map with as many channels as columns (alexnet-r's 32 on 32x32) got its
    bias added along the width."""

    def call(self, inputs: Any) -> Any:
        if not (self.use_bias and self.data_format == "channels_first"):
            return super().call(inputs)
        outputs = tf.nn.bias_add(self.convolution_op(inputs, self.kernel), self.bias,
                                 data_format="NCHW")
        return outputs if self.activation is None else self.activation(outputs)


class _Layers:
    """Layer factories bound to one data format, so that no image layer can be
    built with the wrong layout."""

    def __init__(self, data_format: str) -> None:
        self.data_format = data_format
        self.channel_axis = 1 if data_format == "channels_first" else -1

    def conv(self, filters: int, kernel: int, name: str, *, strides: int = 1,
             padding: str = "same", use_bias: bool = True,
             activation: str | None = None) -> Any:
        return ChannelBiasConv2D(filters, kernel, strides=strides, padding=padding,
                                 use_bias=use_bias, activation=activation,
                                 data_format=self.data_format, name=name)

    def pad(self, amount: int, name: str) -> Any:
        return keras.layers.ZeroPadding2D(amount, data_format=self.data_format, name=name)

    def max_pool(self, size: int, strides: int, name: str) -> Any:
        return keras.layers.MaxPooling2D(size, strides, data_format=self.data_format,
                                         name=name)

    def avg_pool(self, size: int, strides: int, name: str) -> Any:
        return keras.layers.AveragePooling2D(size, strides, data_format=self.data_format,
                                             name=name)

    def batch_norm(self, name: str) -> Any:
        return keras.layers.BatchNormalization(axis=self.channel_axis, epsilon=BN_EPSILON,
                                               momentum=BN_MOMENTUM, name=name)

    def flatten(self, name: str = "flatten") -> Any:
        return keras.layers.Flatten(data_format=self.data_format, name=name)

    def global_pool(self, name: str = "global_pool") -> Any:
        return keras.layers.GlobalAveragePooling2D(data_format=self.data_format, name=name)


class SubsampleZeroPad(keras.layers.Layer):  # type: ignore[misc]
    """The parameter-free shortcut of CIFAR ResNets (He et al., option A): keeps
    every other row and column and zero-pads the channels, half on each side."""

    def __init__(self, extra_channels: int, data_format: str = "channels_last",
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra_channels = extra_channels
        self.data_format = data_format

    def call(self, inputs: Any) -> Any:
        before = self.extra_channels // 2
        after = self.extra_channels - before
        if self.data_format == "channels_first":
            return keras.ops.pad(inputs[:, :, ::2, ::2],
                                 [[0, 0], [before, after], [0, 0], [0, 0]])
        return keras.ops.pad(inputs[:, ::2, ::2, :], [[0, 0], [0, 0], [0, 0], [before, after]])

    def compute_output_shape(self, input_shape: tuple[int | None, ...]
                             ) -> tuple[int | None, ...]:
        def half(size: int | None) -> int | None:
            return None if size is None else (size + 1) // 2

        if self.data_format == "channels_first":
            batch, channels, height, width = input_shape
            assert channels is not None
            return (batch, channels + self.extra_channels, half(height), half(width))
        batch, height, width, channels = input_shape
        assert channels is not None
        return (batch, half(height), half(width), channels + self.extra_channels)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(extra_channels=self.extra_channels, data_format=self.data_format)
        return config


def _fcn_s(spec: ModelSpec, data_format: str) -> Any:
    inputs = keras.Input(spec.input_shape, name="features")
    x = inputs
    for i in range(1, 5):
        x = keras.layers.Dense(2048, activation="relu", name=f"fc{i}")(x)
    outputs = keras.layers.Dense(spec.classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="fcn_s")


def _fcn_r(spec: ModelSpec, data_format: str) -> Any:
    inputs = keras.Input(spec.input_shape, name="features")
    x = inputs
    for i, units in enumerate((2048, 4096, 1024), start=1):
        x = keras.layers.Dense(units, activation="relu", name=f"fc{i}")(x)
    outputs = keras.layers.Dense(spec.classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="fcn_r")


def _alexnet_s(spec: ModelSpec, data_format: str) -> Any:
    lay = _Layers(data_format)
    inputs = keras.Input(_image_shape(spec, data_format), name="images")
    # PyTorch's padding=2: 224 + 4 -> 55 after the 11x11/4 convolution.
    x = lay.pad(2, "conv1_pad")(inputs)
    x = lay.conv(96, 11, "conv1", strides=4, padding="valid", activation="relu")(x)
    x = lay.max_pool(3, 2, "pool1")(x)  # 27
    x = lay.conv(256, 5, "conv2", activation="relu")(x)
    x = lay.max_pool(3, 2, "pool2")(x)  # 13
    x = lay.conv(384, 3, "conv3", activation="relu")(x)
    x = lay.conv(384, 3, "conv4", activation="relu")(x)
    x = lay.conv(256, 3, "conv5", activation="relu")(x)
    x = lay.max_pool(3, 2, "pool5")(x)  # 6x6x256
    x = lay.flatten()(x)
    x = keras.layers.Dense(4096, activation="relu", name="fc6")(x)
    x = keras.layers.Dense(4096, activation="relu", name="fc7")(x)
    outputs = keras.layers.Dense(spec.classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="alexnet_s")


def _alexnet_r(spec: ModelSpec, data_format: str) -> Any:
    lay = _Layers(data_format)
    inputs = keras.Input(_image_shape(spec, data_format), name="images")
    x = lay.conv(32, 5, "conv1")(inputs)
    # PyTorch pads its max pool with -inf, here with zeros; the ReLU after the
    # pool makes the two equal. Its average pool counts the padding
    # (count_include_pad), as zero padding and a valid pool do. 32 -> 16.
    x = lay.pad(1, "pool1_pad")(x)
    x = lay.max_pool(3, 2, "pool1")(x)
    x = keras.layers.ReLU(name="relu1")(x)
    x = lay.conv(32, 5, "conv2", activation="relu")(x)
    x = lay.pad(1, "pool2_pad")(x)
    x = lay.avg_pool(3, 2, "pool2")(x)  # 8
    x = lay.conv(64, 5, "conv3", activation="relu")(x)
    x = lay.pad(1, "pool3_pad")(x)
    x = lay.avg_pool(3, 2, "pool3")(x)  # 4
    x = lay.flatten()(x)  # 4 * 4 * 64 = 1024
    outputs = keras.layers.Dense(spec.classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="alexnet_r")


def _conv3x3(lay: _Layers, x: Any, filters: int, strides: int, name: str) -> Any:
    """A 3x3 convolution without bias, padded by 1 on every side like PyTorch's
    padding=1. Keras's "same" pads a stride-2 convolution of an even input on
    the bottom and right only, which would shift every output by one pixel."""
    if strides == 1:
        return lay.conv(filters, 3, name, use_bias=False)(x)
    x = lay.pad(1, f"{name}_pad")(x)
    return lay.conv(filters, 3, name, strides=strides, padding="valid", use_bias=False)(x)


def _bottleneck(lay: _Layers, x: Any, width: int, *, strides: int, project: bool,
                name: str) -> Any:
    shortcut = x
    if project:
        shortcut = lay.conv(4 * width, 1, f"{name}_proj_conv", strides=strides,
                            padding="valid", use_bias=False)(x)
        shortcut = lay.batch_norm(f"{name}_proj_bn")(shortcut)
    y = lay.conv(width, 1, f"{name}_conv1", use_bias=False)(x)
    y = lay.batch_norm(f"{name}_bn1")(y)
    y = keras.layers.ReLU(name=f"{name}_relu1")(y)
    # Stride on the 3x3 convolution, as torchvision's ResNet v1.5 does.
    y = _conv3x3(lay, y, width, strides, f"{name}_conv2")
    y = lay.batch_norm(f"{name}_bn2")(y)
    y = keras.layers.ReLU(name=f"{name}_relu2")(y)
    y = lay.conv(4 * width, 1, f"{name}_conv3", use_bias=False)(y)
    y = lay.batch_norm(f"{name}_bn3")(y)
    y = keras.layers.Add(name=f"{name}_add")([y, shortcut])
    return keras.layers.ReLU(name=f"{name}_out")(y)


def _resnet_50(spec: ModelSpec, data_format: str) -> Any:
    lay = _Layers(data_format)
    inputs = keras.Input(_image_shape(spec, data_format), name="images")
    x = lay.pad(3, "stem_pad")(inputs)
    x = lay.conv(64, 7, "stem_conv", strides=2, padding="valid", use_bias=False)(x)  # 112
    x = lay.batch_norm("stem_bn")(x)
    x = keras.layers.ReLU(name="stem_relu")(x)
    # Zeros pad as well as PyTorch's -inf here: the inputs are ReLU outputs.
    x = lay.pad(1, "stem_pool_pad")(x)
    x = lay.max_pool(3, 2, "stem_pool")(x)  # 56
    for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512),
                                                strict=True), start=1):
        for block in range(1, blocks + 1):
            strides = 2 if stage > 1 and block == 1 else 1
            x = _bottleneck(lay, x, width, strides=strides, project=block == 1,
                            name=f"stage{stage}_block{block}")
    x = lay.global_pool()(x)
    outputs = keras.layers.Dense(spec.classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="resnet_50")


def _basic_block(lay: _Layers, x: Any, in_channels: int, channels: int, *, strides: int,
                 name: str) -> Any:
    y = _conv3x3(lay, x, channels, strides, f"{name}_conv1")
    y = lay.batch_norm(f"{name}_bn1")(y)
    y = keras.layers.ReLU(name=f"{name}_relu1")(y)
    y = _conv3x3(lay, y, channels, 1, f"{name}_conv2")
    y = lay.batch_norm(f"{name}_bn2")(y)
    shortcut = x
    if strides != 1 or in_channels != channels:
        shortcut = SubsampleZeroPad(channels - in_channels, lay.data_format,
                                    name=f"{name}_shortcut")(x)
    y = keras.layers.Add(name=f"{name}_add")([y, shortcut])
    return keras.layers.ReLU(name=f"{name}_out")(y)


def _resnet_56(spec: ModelSpec, data_format: str) -> Any:
    lay = _Layers(data_format)
    inputs = keras.Input(_image_shape(spec, data_format), name="images")
    x = _conv3x3(lay, inputs, 16, 1, "stem_conv")
    x = lay.batch_norm("stem_bn")(x)
    x = keras.layers.ReLU(name="stem_relu")(x)
    in_channels = 16
    for stage, channels in enumerate((16, 32, 64), start=1):
        for block in range(1, 10):
            strides = 2 if stage > 1 and block == 1 else 1
            x = _basic_block(lay, x, in_channels, channels, strides=strides,
                             name=f"stage{stage}_block{block}")
            in_channels = channels
    x = lay.global_pool()(x)
    outputs = keras.layers.Dense(spec.classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="resnet_56")


def _lstm(spec: ModelSpec, data_format: str) -> Any:
    inputs = keras.Input(spec.input_shape, dtype="int32", name="tokens")
    x = keras.layers.Embedding(spec.classes, 500, name="embedding")(inputs)
    # One bias per gate (4 x 500); PyTorch's second bias is frozen at zero.
    x = keras.layers.LSTM(500, return_sequences=True, name="lstm1")(x)
    x = keras.layers.LSTM(500, return_sequences=True, name="lstm2")(x)
    outputs = keras.layers.Dense(spec.classes, name="logits")(x)  # at every step
    return keras.Model(inputs, outputs, name="lstm")


def _small_cnn(spec: ModelSpec, data_format: str) -> Any:
    lay = _Layers(data_format)
    inputs = keras.Input(_image_shape(spec, data_format), name="images")
    x = lay.conv(16, 3, "conv1", activation="relu")(inputs)
    x = lay.max_pool(2, 2, "pool1")(x)
    x = lay.conv(32, 3, "conv2", activation="relu")(x)
    x = lay.max_pool(2, 2, "pool2")(x)
    x = lay.flatten()(x)
    x = keras.layers.Dense(64, activation="relu", name="fc1")(x)
    outputs = keras.layers.Dense(spec.classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="small_cnn")


_BUILDERS: dict[str, Callable[[ModelSpec, str], Any]] = {
    "fcn-s": _fcn_s,
    "fcn-r": _fcn_r,
    "alexnet-s": _alexnet_s,
    "alexnet-r": _alexnet_r,
    "resnet-50": _resnet_50,
    "resnet-56": _resnet_56,
    "lstm": _lstm,
    "small-cnn": _small_cnn,
}


def build(name: str, *, data_format: str = "channels_last") -> keras.Model:
    """The Keras model `name` of `MODELS`, uncompiled."""
    spec = _spec(name)
    _check_data_format(data_format)
    # Fail here rather than at the first step, with a reason instead of a kernel error.
    if spec.kind == "image" and data_format == "channels_first" and not nchw_trains_here():
        raise ValueError("data_format='channels_first' (NCHW) needs a GPU on TensorFlow: "
                         "its CPU convolutions support NCHW only with oneDNN, which is off "
                         "here (TF_ENABLE_ONEDNN_OPTS=0, or a build without it)")
    return _BUILDERS[name](spec, data_format)


def trainable_parameters(model: keras.Model) -> int:
    return sum(int(np.prod(weight.shape)) for weight in model.trainable_weights)


def example_batch(name: str, batch: int, *, seed: int = 0,
                  data_format: str = "channels_last"
                  ) -> tuple[npt.NDArray[Any], npt.NDArray[np.int32]]:
    """Synthetic inputs and targets for one step of `name`, the same for the same
    seed: float32 features or images (NCHW for "channels_first"), int32 token ids
    for the LSTM; int32 class ids as targets, one per token for the LSTM."""
    spec = _spec(name)
    _check_data_format(data_format)
    rng = np.random.default_rng(seed)
    inputs: npt.NDArray[Any]
    if spec.kind == "sequence":
        inputs = rng.integers(0, spec.classes, (batch, *spec.input_shape), dtype=np.int32)
        targets = rng.integers(0, spec.classes, (batch, *spec.input_shape), dtype=np.int32)
        return inputs, targets
    shape = _image_shape(spec, data_format) if spec.kind == "image" else spec.input_shape
    inputs = rng.standard_normal((batch, *shape), dtype=np.float32)
    return inputs, rng.integers(0, spec.classes, (batch,), dtype=np.int32)


def loss(name: str) -> keras.losses.Loss:
    """The training loss of `name`: every model ends in logits over classes."""
    _spec(name)
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

