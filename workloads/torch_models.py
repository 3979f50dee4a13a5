"""PyTorch models of the reference workloads."""

from __future__ import annotations

from torch import nn


def small_cnn(classes: int = 10) -> nn.Sequential:
    """A CIFAR-10-sized CNN (32x32x3 input): two conv/ReLU/pool blocks and two
    dense layers, 137k parameters; small enough for a CPU step of ~10 ms."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, classes))
