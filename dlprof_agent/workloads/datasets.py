"""Readers for the dataset files the papers trained on, MNIST (IDX) and CIFAR-10
(binary version), for when a user points a workload at real files; by default
the workloads use `synthetic` data and nothing is ever downloaded.

Every malformed file raises `DatasetError` with a one-line message naming it.
Files are decoded in bulk with `np.frombuffer`, never sample by sample.
"""

from __future__ import annotations

import gzip
import os
import re
import zlib
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

StrPath = str | os.PathLike[str]
FloatArray = npt.NDArray[np.float32]
LabelArray = npt.NDArray[np.int64]
ScalarT = TypeVar("ScalarT", bound=np.generic)

_GZIP_MAGIC = b"\x1f\x8b"
# IDX stores every multi-byte value big-endian, whatever the machine that wrote it.
_IDX_TYPES: dict[int, np.dtype[np.generic]] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
MNIST_SIDE = 28
CLASSES = 10  # both MNIST and CIFAR-10
CIFAR_SIDE = 32
CIFAR_PIXELS = 3 * CIFAR_SIDE * CIFAR_SIDE
CIFAR_RECORD = 1 + CIFAR_PIXELS


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message is one line naming the file."""


def _error(path: StrPath, problem: str) -> DatasetError:
    # One line even when a path or an OS message holds a newline: the CLI prints it as is.
    return DatasetError(" ".join(f"{os.fspath(path)}: {problem}".splitlines()))


def _read_bytes(path: StrPath) -> bytes:
    """The file's content, decompressed when it starts with the gzip magic."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as e:
        raise _error(path, f"cannot read: {e.strerror or e}") from None
    if data.startswith(_GZIP_MAGIC):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise _error(path, f"bad gzip data: {e}") from None
    return data


def _size_problem(expected: int, found: int) -> str:
    kind = "truncated" if found < expected else "trailing data"
    return f"{kind}: {expected} bytes of data expected, {found} found"


def read_idx(path: StrPath) -> npt.NDArray[np.generic]:
    """The array an IDX file holds (plain or gzip-compressed), in native byte order."""
    data = _read_bytes(path)
    if len(data) < 4:
        raise _error(path, f"truncated: 4-byte IDX header expected, {len(data)} bytes found")
    if data[:2] != b"\0\0":
        raise _error(path, f"bad magic 0x{data[:4].hex()}: not an IDX file")
    dtype = _IDX_TYPES.get(data[2])
    if dtype is None:
        raise _error(path, f"unknown IDX type code 0x{data[2]:02x}")
    ndims = data[3]
    header = 4 + 4 * ndims
    if len(data) < header:
        raise _error(path, f"truncated: {header}-byte header for {ndims} dimensions "
                           f"expected, {len(data)} bytes found")
    shape = tuple(int(d) for d in np.frombuffer(data, ">u4", ndims, 4))
    count = 1
    for d in shape:  # Python ints: a corrupt header must not overflow into a small size
        count *= d
    expected, found = count * dtype.itemsize, len(data) - header
    if found != expected:
        raise _error(path, _size_problem(expected, found))
    values = np.frombuffer(data, dtype, count, header).reshape(shape)
    # One copy: native byte order, writable, and no longer tied to the file's bytes.
    return values.astype(dtype.newbyteorder("="))


def _check_labels(path: StrPath, labels: npt.NDArray[np.uint8]) -> LabelArray:
    bad = np.flatnonzero(labels >= CLASSES)
    if bad.size:
        raise _error(path, f"label {labels[bad[0]]} at index {bad[0]}: "
                           f"labels must be 0-{CLASSES - 1}")
    return labels.astype(np.int64)


def load_mnist(images_path: StrPath, labels_path: StrPath) -> tuple[FloatArray, LabelArray]:
    """MNIST images as float32 in [0, 1] shaped (N, 784), as FCN-R takes them, and
    their int64 labels (N,)."""
    images = read_idx(images_path)
    if images.dtype != np.uint8 or images.ndim != 3:
        raise _error(images_path, f"expected unsigned-byte images (N, rows, columns), "
                                  f"found {images.dtype} of shape {images.shape}")
    if images.shape[1:] != (MNIST_SIDE, MNIST_SIDE):
        raise _error(images_path, f"expected {MNIST_SIDE}x{MNIST_SIDE} images, found "
                                  f"{images.shape[1]}x{images.shape[2]}")
    labels = read_idx(labels_path)
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise _error(labels_path, f"expected unsigned-byte labels (N,), "
                                  f"found {labels.dtype} of shape {labels.shape}")
    if len(labels) != len(images):
        raise _error(labels_path, f"{len(labels)} labels for {len(images)} images "
                                  f"in {os.fspath(images_path)}")
    pixels = np.divide(images.reshape(len(images), -1), np.float32(255), dtype=np.float32)
    return pixels, _check_labels(labels_path, labels.view(np.uint8))


def _cifar_records(path: StrPath) -> npt.NDArray[np.uint8]:
    data = _read_bytes(path)
    if not data:
        raise _error(path, "empty: no CIFAR-10 records")
    if len(data) % CIFAR_RECORD:
        raise _error(path, f"{len(data)} bytes is not a whole number of "
                           f"{CIFAR_RECORD}-byte CIFAR-10 records")
    return np.frombuffer(data, np.uint8).reshape(-1, CIFAR_RECORD)


def _batch_number(name: str) -> tuple[int, str]:
    # data_batch_10 after data_batch_9, should a directory hold more than the five.
    match = re.search(r"(\d+)\.bin$", name)
    return (int(match.group(1)) if match else -1, name)


def _cifar_files(directory: StrPath, train: bool) -> list[str]:
    if not train:
        return [os.path.join(directory, "test_batch.bin")]
    try:
        names = os.listdir(directory)
    except OSError as e:
        raise _error(directory, f"cannot list: {e.strerror or e}") from None
    found = sorted((n for n in names if re.fullmatch(r"data_batch_.*\.bin", n)),
                   key=_batch_number)
    if not found:
        raise _error(directory, "no data_batch_*.bin files in this directory")
    return [os.path.join(directory, n) for n in found]


def load_cifar10(source: StrPath | Sequence[StrPath], *,
                 train: bool = True) -> tuple[FloatArray, LabelArray]:
    """CIFAR-10 images as float32 in [0, 1] shaped (N, 32, 32, 3), channels last, and
    their int64 labels (N,).

    `source` is one batch file, a list of them (loaded in order), or a directory: then
    every `data_batch_*.bin` in it, or its `test_batch.bin` when `train` is false.
    `train` matters only for a directory.
    """
    if isinstance(source, (str, os.PathLike)):
        paths: Sequence[StrPath] = (_cifar_files(source, train) if os.path.isdir(source)
                                    else [source])
    else:
        paths = list(source)
    if not paths:
        raise DatasetError("no CIFAR-10 files given")
    # The raw bytes are a quarter the size of the floats: keep them all, then fill one
    # float array, so the peak stays near the dataset itself.
    records = [_cifar_records(path) for path in paths]
    total = sum(len(r) for r in records)
    images = np.empty((total, CIFAR_SIDE, CIFAR_SIDE, 3), np.float32)
    labels = np.empty(total, np.int64)
    start = 0
    for path, rec in zip(paths, records, strict=True):
        stop = start + len(rec)
        labels[start:stop] = _check_labels(path, rec[:, 0])
        # Stored as three 32x32 planes, R then G then B: channels move last.
        planes = rec[:, 1:].reshape(-1, 3, CIFAR_SIDE, CIFAR_SIDE).transpose(0, 2, 3, 1)
        np.divide(planes, np.float32(255), out=images[start:stop], dtype=np.float32)
        start = stop
    return images, labels


def synthetic(shape_per_sample: Sequence[int], count: int, classes: int, *,
              seed: int) -> tuple[FloatArray, LabelArray]:
    """`count` standard-normal float32 samples of `shape_per_sample` and int64 labels
    in [0, classes), the same for the same seed."""
    if count < 0:
        raise ValueError(f"count must be >= 0, not {count}")
    if classes < 1:
        raise ValueError(f"classes must be >= 1, not {classes}")
    rng = np.random.default_rng(seed)
    inputs = rng.standard_normal((count, *shape_per_sample), dtype=np.float32)
    labels = rng.integers(0, classes, count, dtype=np.int64)
    return inputs, labels


class Batches(Generic[ScalarT]):
    """Endless mini-batches of exactly `batch_size` samples, cycling through the
    dataset in a fresh seeded order each epoch.

    A batch that runs past the end of an epoch continues with the start of the next,
    so every sample is seen equally often. Only the current batch is copied.
    """

    def __init__(self, inputs: npt.NDArray[ScalarT], labels: LabelArray, batch_size: int,
                 *, seed: int, shuffle: bool = True) -> None:
        if len(inputs) != len(labels):
            raise ValueError(f"{len(inputs)} inputs but {len(labels)} labels")
        if len(inputs) == 0:
            raise ValueError("cannot make batches of an empty dataset")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, not {batch_size}")
        self.inputs = inputs
        self.labels = labels
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.epoch = 0  # epochs started so far
        self._rng = np.random.default_rng(seed)
        self._order = np.arange(len(inputs))
        self._position = len(inputs)  # the first batch starts the first epoch

    def __iter__(self) -> Iterator[tuple[npt.NDArray[ScalarT], LabelArray]]:
        return self

    def __next__(self) -> tuple[npt.NDArray[ScalarT], LabelArray]:
        pieces: list[npt.NDArray[np.intp]] = []
        wanted = self.batch_size
        while wanted:
            if self._position == len(self._order):
                self._next_epoch()
            take = min(wanted, len(self._order) - self._position)
            pieces.append(self._order[self._position:self._position + take])
            self._position += take
            wanted -= take
        index = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        return self.inputs[index], self.labels[index]

    def _next_epoch(self) -> None:
        if self.shuffle:
            self._order = self._rng.permutation(len(self.inputs))
        self._position = 0
        self.epoch += 1
