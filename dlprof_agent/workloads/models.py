"""The reference models of the papers' benchmarks, described once for both
frameworks: `torch_models` and `keras_models` build each one with the same
architecture and the same number of trainable parameters.

Parameter counts from the papers are theirs (Shi et al., Tables 2 and 3; Kim
et al., Table II): some are approximate or inconsistent, so `dlprof-agent
workload list` shows the real counts beside them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    paper_params: str  # as the paper gives it
    input_shape: tuple[int, ...]  # one sample, channels last for images (H, W, C)
    classes: int  # outputs of the last layer; for the LSTM, the vocabulary
    cpu_batch: int  # the batch the papers used on CPUs
    kind: str  # "vector", "image" or "sequence"


MODELS = {spec.name: spec for spec in (
    ModelSpec("fcn-s", "fully connected, 26752 -> 4 hidden x 2048 (ReLU) -> 26752 (Shi et al.)",
              "~55M", (26752,), 26752, 64, "vector"),
    ModelSpec("fcn-r", "fully connected on MNIST, 784 -> 2048 -> 4096 -> 1024 (ReLU) -> 10 "
              "(Shi et al.)", "~13M", (784,), 10, 1024, "vector"),
    ModelSpec("alexnet-s", "AlexNet on 224x224x3 -> 1000: conv 11x11/4 96, pool, conv 5x5 256, "
              "pool, conv 3x3 384, 384, 256, pool, fc 4096, 4096, 1000; no LRN, BN, dropout or "
              "groups (Shi et al.; Kim et al. Table II)", "~61M", (224, 224, 3), 1000, 16,
              "image"),
    ModelSpec("alexnet-r", "cuda-convnet's CIFAR-10 net: conv 5x5 32, max pool, conv 5x5 32, "
              "avg pool, conv 5x5 64, avg pool (3x3/2, padding 1), fc 10; no LRN (Shi et al.)",
              "~81K", (32, 32, 3), 10, 128, "image"),
    ModelSpec("resnet-50", "ResNet-50 on 224x224x3 -> 1000: bottleneck blocks [3, 4, 6, 3], "
              "batch norm, convolutions without bias (He et al.; Shi et al.)", "~25.6M",
              (224, 224, 3), 1000, 16, "image"),
    ModelSpec("resnet-56", "ResNet-56 on CIFAR-10: 3 stages x 9 basic blocks of 16, 32, 64 "
              "channels, identity shortcuts zero-padded on downsampling (He et al. option A; "
              "Shi et al.)", "~0.85M", (32, 32, 3), 10, 128, "image"),
    ModelSpec("lstm", "language model: embedding 10000 x 500, 2 LSTM layers of 500 (one bias "
              "vector per gate), sequence 32, linear 500 -> 10000 (Shi et al.)", "~13M",
              (32,), 10000, 256, "sequence"),
    ModelSpec("small-cnn", "a small CIFAR-10 CNN: conv 3x3 16, max pool, conv 3x3 32, max pool, "
              "fc 64, fc 10 (the project's own quick reference)", "-", (32, 32, 3), 10, 32,
              "image"),
)}
