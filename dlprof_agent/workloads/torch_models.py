"""PyTorch models of the reference workloads.

`build(name)` makes each model of `dlprof_agent.workloads.models.MODELS` with the
architecture its description gives; `keras_models` builds the same ones, and the
two must agree on every model's trainable-parameter count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlprof_agent.workloads.models import MODELS, ModelSpec

LossFn = Callable[[Tensor, Tensor], Tensor]


def small_cnn(classes: int = 10) -> nn.Sequential:
    """A CIFAR-10-sized CNN (32x32x3 input): two conv/ReLU/pool blocks and two
    dense layers, 137k parameters; small enough for a CPU step of ~10 ms."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, classes))


def fcn_s() -> nn.Sequential:
    """Shi et al.'s synthetic FCN: 26752 -> 4 x 2048 (ReLU) -> 26752."""
    width, io = 2048, MODELS["fcn-s"].classes
    layers: list[nn.Module] = [nn.Linear(io, width), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, io))
    return nn.Sequential(*layers)


def fcn_r() -> nn.Sequential:
    """Shi et al.'s MNIST FCN: 784 -> 2048 -> 4096 -> 1024 (ReLU) -> 10."""
    return nn.Sequential(
        nn.Linear(784, 2048), nn.ReLU(),
        nn.Linear(2048, 4096), nn.ReLU(),
        nn.Linear(4096, 1024), nn.ReLU(),
        nn.Linear(1024, 10))


class AlexNet(nn.Module):
    """AlexNet without LRN, dropout or groups, for 224x224x3 inputs. The
    submodule names follow torchvision's (`features.0`, `classifier.2`) so that
    per-layer timings read the same as for the model people know."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.features = nn.Sequential(
            # padding 2 makes 224 -> 55 as in the paper; Keras needs ZeroPadding2D(2) + "valid".
            nn.Conv2d(3, 96, 11, stride=4, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(96, 256, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(),
            nn.Conv2d(384, 384, 3, padding=1), nn.ReLU(),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2))  # -> 256x6x6
        self.flatten = nn.Flatten()
        self.classifier = nn.Sequential(
            nn.Linear(256 * 6 * 6, 4096), nn.ReLU(),
            nn.Linear(4096, 4096), nn.ReLU(),
            nn.Linear(4096, classes))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.classifier(self.flatten(self.features(x)))
        return out


def alexnet_r() -> nn.Sequential:
    """cuda-convnet's CIFAR-10 net (layers-18pct without LRN): 32 -> 16 -> 8 -> 4.

    The pools are 3x3/2 with padding 1, which gives the same output sizes as
    Keras' "same" pooling, so the dense layer has 64*4*4 inputs in both. Their
    values differ a little: PyTorch's windows start one pixel before the image
    (the top/left padding; the bottom/right one goes unused) and its average
    pools count the padded zeros (count_include_pad), whereas Keras pads only
    bottom/right and averages over the real pixels only. Parameter counts, all
    that must match, do not depend on it.
    """
    return nn.Sequential(
        # cuda-convnet pools before the first ReLU; max and ReLU commute, so it is only the order.
        nn.Conv2d(3, 32, 5, padding=2), nn.MaxPool2d(3, 2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 32, 5, padding=2), nn.ReLU(), nn.AvgPool2d(3, 2, padding=1),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.AvgPool2d(3, 2, padding=1),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 10))


def _conv(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    # Batch norm follows every ResNet convolution and has its own shift, so no bias.
    return nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)


def _he_init(model: nn.Module) -> None:
    # He et al.'s initialisation, so that the deep nets train from scratch as in the papers.
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4; a 1x1 projection
    with batch norm on the shortcut where the shape changes."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv(cin, width, 1), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv(width, width, 3, stride), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = _conv(width, cout, 1), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv(cin, cout, 1, stride), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        result: Tensor = self.relu(out + self.downsample(x))
        return result


class ResNet50(nn.Module):
    """ResNet-50 (He et al. 2016) for 224x224x3 inputs."""

    def __init__(self, classes: int = 1000, blocks: tuple[int, ...] = (3, 4, 6, 3)) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        cin = 64
        stages: list[nn.Sequential] = []
        for index, count in enumerate(blocks):
            width = 64 * 2 ** index
            stride = 1 if index == 0 else 2  # the stem's max pool already halved stage 1
            stage = [Bottleneck(cin, width, stride)]
            cin = width * Bottleneck.expansion
            stage += [Bottleneck(cin, width) for _ in range(count - 1)]
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)
        _he_init(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        out: Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return out


class BasicBlock(nn.Module):
    """Two 3x3 convolutions; on downsampling the shortcut is option A of He et
    al.: every other pixel, with the new channels zero, so it has no parameters."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv(cin, cout, 3, stride), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = _conv(cout, cout, 3), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.stride, self.extra_channels = stride, cout - cin

    def shortcut(self, x: Tensor) -> Tensor:
        if self.stride != 1:
            x = x[:, :, ::self.stride, ::self.stride]
        if self.extra_channels:
            # F.pad pads the last dimensions first: (W, W, H, H, C before, C after).
            x = F.pad(x, (0, 0, 0, 0, 0, self.extra_channels))
        return x

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        result: Tensor = self.relu(out + self.shortcut(x))
        return result


class CifarResNet(nn.Module):
    """He et al.'s CIFAR-10 ResNet-(6n+2): three stages of n basic blocks of
    16, 32 and 64 channels; n = 9 gives ResNet-56."""

    def __init__(self, n: int = 9, classes: int = 10) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv(3, 16, 3), nn.BatchNorm2d(16)
        self.relu = nn.ReLU()
        cin = 16
        stages: list[nn.Sequential] = []
        for index, cout in enumerate((16, 32, 64)):
            stride = 1 if index == 0 else 2
            stage = [BasicBlock(cin, cout, stride)]
            stage += [BasicBlock(cout, cout) for _ in range(n - 1)]
            stages.append(nn.Sequential(*stage))
            cin = cout
        self.layer1, self.layer2, self.layer3 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, classes)
        _he_init(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        out: Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return out


class LSTMLanguageModel(nn.Module):
    """Embedding, a stacked LSTM and a dense layer over the vocabulary at every
    time step: (batch, steps) token ids -> (batch, steps, vocabulary) logits."""

    def __init__(self, vocabulary: int = 10000, hidden: int = 500, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=layers, batch_first=True)
        # PyTorch adds two bias vectors per gate (b_ih + b_hh), Keras and the paper one: a
        # frozen zero b_hh leaves the same function and the same trainable parameters.
        for name, parameter in self.lstm.named_parameters():
            if name.startswith("bias_hh"):
                nn.init.zeros_(parameter)
                parameter.requires_grad_(False)
        self.fc = nn.Linear(hidden, vocabulary)

    def forward(self, ids: Tensor) -> Tensor:
        states, _ = self.lstm(self.embedding(ids))
        out: Tensor = self.fc(states)
        return out


_BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "fcn-s": fcn_s,
    "fcn-r": fcn_r,
    "alexnet-s": AlexNet,
    "alexnet-r": alexnet_r,
    "resnet-50": ResNet50,
    "resnet-56": CifarResNet,
    "lstm": LSTMLanguageModel,
    "small-cnn": small_cnn,
}


def _spec(name: str) -> ModelSpec:
    if name not in MODELS or name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name]


def build(name: str) -> nn.Module:
    """A new, randomly initialised model `name` of MODELS."""
    _spec(name)
    return _BUILDERS[name]()


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def example_batch(name: str, batch: int, *,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Synthetic inputs and targets for training `name`: images NCHW float32,
    vectors float32 and class indices; for the LSTM, token ids and the next
    token of each. Seeded with 0 unless a generator is given, so that runs repeat."""
    spec = _spec(name)
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    if spec.kind == "sequence":
        (steps,) = spec.input_shape
        ids = torch.randint(0, spec.classes, (batch, steps + 1), generator=generator)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    if spec.kind == "image":
        height, width, channels = spec.input_shape
        inputs = torch.randn(batch, channels, height, width, generator=generator)
    else:
        inputs = torch.randn(batch, *spec.input_shape, generator=generator)
    return inputs, torch.randint(0, spec.classes, (batch,), generator=generator)


def loss_fn(name: str) -> LossFn:
    """Cross-entropy over the classes; for the LSTM, over every time step."""
    spec = _spec(name)
    cross_entropy = nn.CrossEntropyLoss()
    if spec.kind != "sequence":
        return cross_entropy

    def sequence_loss(logits: Tensor, targets: Tensor) -> Tensor:
        loss: Tensor = cross_entropy(logits.reshape(-1, spec.classes), targets.reshape(-1))
        return loss

    return sequence_loss
