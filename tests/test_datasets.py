"""The dataset readers: small MNIST IDX and CIFAR-10 binary files written here
round-trip exactly, every malformed file gives a one-line DatasetError naming it,
and the synthetic data and the batches are deterministic per seed."""

from __future__ import annotations

import gzip
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from dlprof_agent.workloads.datasets import (
    Batches,
    DatasetError,
    load_cifar10,
    load_mnist,
    read_idx,
    synthetic,
)

IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(np.int16): 0x0B,
             np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D, np.dtype(np.float64): 0x0E}


def idx_bytes(array: npt.NDArray[np.generic]) -> bytes:
    header = struct.pack(">BBBB", 0, 0, IDX_CODES[array.dtype], array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write(path: Path, data: bytes, *, compress: bool = False) -> Path:
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def mnist_files(tmp_path: Path, count: int = 5, *, compress: bool = False,
                ) -> tuple[Path, Path, npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
    images[0, 0, 0], images[0, 0, 1] = 0, 255  # both ends of the range
    labels = np.arange(count, dtype=np.uint8) % 10
    suffix = ".gz" if compress else ""
    return (write(tmp_path / f"train-images-idx3-ubyte{suffix}", idx_bytes(images),
                  compress=compress),
            write(tmp_path / f"train-labels-idx1-ubyte{suffix}", idx_bytes(labels),
                  compress=compress),
            images, labels)


def cifar_bytes(images: npt.NDArray[np.uint8], labels: npt.NDArray[np.uint8]) -> bytes:
    """Records as the CIFAR-10 binary version stores them, from (N, 32, 32, 3) images."""
    planes = images.transpose(0, 3, 1, 2).reshape(len(images), -1)  # R plane, G, B
    return np.concatenate([labels[:, None], planes], axis=1).tobytes()


def cifar_data(count: int, seed: int) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8),
            rng.integers(0, 10, count, dtype=np.uint8))


def assert_one_line_naming(error: pytest.ExceptionInfo[DatasetError], path: Path,
                           *words: str) -> None:
    message = str(error.value)
    assert "\n" not in message
    assert str(path) in message
    for word in words:
        assert word in message


# MNIST / IDX

@pytest.mark.parametrize("dtype", list(IDX_CODES))
@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_round_trips_every_type(tmp_path: Path, dtype: np.dtype[np.generic],
                                         compress: bool) -> None:
    values = (np.arange(24) * (-1) ** np.arange(24) * 3).astype(dtype).reshape(2, 3, 4)
    if dtype.kind == "u":
        values = np.arange(24, dtype=dtype).reshape(2, 3, 4) * 10
    path = write(tmp_path / "values", idx_bytes(values), compress=compress)
    read = read_idx(path)
    assert read.dtype == dtype and read.dtype.isnative
    assert read.shape == (2, 3, 4)
    np.testing.assert_array_equal(read, values)
    read[0, 0, 0] = 1  # writable: not a view of the file's bytes


def test_gzip_is_detected_by_content_not_name(tmp_path: Path) -> None:
    values = np.arange(6, dtype=np.int32).reshape(2, 3)
    compressed = write(tmp_path / "plain-name", idx_bytes(values), compress=True)
    plain = write(tmp_path / "looks-compressed.gz", idx_bytes(values))
    np.testing.assert_array_equal(read_idx(compressed), values)
    np.testing.assert_array_equal(read_idx(plain), values)


@pytest.mark.parametrize("compress", [False, True])
def test_load_mnist(tmp_path: Path, compress: bool) -> None:
    images_path, labels_path, images, labels = mnist_files(tmp_path, compress=compress)
    x, y = load_mnist(images_path, labels_path)
    assert x.shape == (5, 784) and x.dtype == np.float32
    assert y.shape == (5,) and y.dtype == np.int64
    np.testing.assert_array_equal(x, images.reshape(5, 784).astype(np.float32) / 255)
    np.testing.assert_array_equal(y, labels)
    assert x.min() == 0.0 and x.max() == 1.0
    np.testing.assert_array_equal(x[1].reshape(28, 28)[3], images[1, 3] / np.float32(255))


def test_load_mnist_accepts_string_paths(tmp_path: Path) -> None:
    images_path, labels_path, _, labels = mnist_files(tmp_path, 2)
    _, y = load_mnist(str(images_path), str(labels_path))
    np.testing.assert_array_equal(y, labels)


IdxCase = Callable[[Path], Path]


def _truncated(tmp_path: Path) -> Path:
    data = idx_bytes(np.zeros((3, 28, 28), np.uint8))
    return write(tmp_path / "train-images-idx3-ubyte", data[:-10])


def _trailing(tmp_path: Path) -> Path:
    return write(tmp_path / "extra", idx_bytes(np.zeros(4, np.uint8)) + b"\0")


def _bad_magic(tmp_path: Path) -> Path:
    return write(tmp_path / "notidx", b"\x01\x02\x08\x01" + bytes(8))


def _bad_type(tmp_path: Path) -> Path:
    return write(tmp_path / "badtype", b"\0\0\x07\x01" + struct.pack(">I", 2) + bytes(2))


def _short_header(tmp_path: Path) -> Path:
    return write(tmp_path / "shortheader", b"\0\0\x08\x03" + struct.pack(">I", 2))


def _tiny(tmp_path: Path) -> Path:
    return write(tmp_path / "tiny", b"\0\0")


def _bad_gzip(tmp_path: Path) -> Path:
    return write(tmp_path / "cut.gz", gzip.compress(idx_bytes(np.zeros(99, np.uint8)))[:-12])


@pytest.mark.parametrize(("case", "words"), [
    (_truncated, ("truncated", f"{3 * 784} bytes of data expected, {3 * 784 - 10} found")),
    (_trailing, ("trailing data", "4 bytes of data expected, 5 found")),
    (_bad_magic, ("bad magic", "0x01020801")),
    (_bad_type, ("type code 0x07",)),
    (_short_header, ("truncated", "header")),
    (_tiny, ("truncated",)),
    (_bad_gzip, ("gzip",)),
])
def test_read_idx_rejects_malformed_files(tmp_path: Path, case: IdxCase,
                                          words: tuple[str, ...]) -> None:
    path = case(tmp_path)
    with pytest.raises(DatasetError) as error:
        read_idx(path)
    assert_one_line_naming(error, path, *words)
    assert isinstance(error.value, ValueError)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "train-images-idx3-ubyte"
    with pytest.raises(DatasetError) as error:
        read_idx(path)
    assert_one_line_naming(error, path, "No such file")


def test_load_mnist_count_mismatch(tmp_path: Path) -> None:
    images_path, _, _, _ = mnist_files(tmp_path, 4)
    labels_path = write(tmp_path / "labels", idx_bytes(np.zeros(3, np.uint8)))
    with pytest.raises(DatasetError) as error:
        load_mnist(images_path, labels_path)
    assert_one_line_naming(error, labels_path, "3 labels for 4 images", str(images_path))


def test_load_mnist_rejects_bad_labels_and_shapes(tmp_path: Path) -> None:
    images_path, _, _, _ = mnist_files(tmp_path, 3)
    labels_path = write(tmp_path / "labels", idx_bytes(np.array([1, 10, 2], np.uint8)))
    with pytest.raises(DatasetError) as error:
        load_mnist(images_path, labels_path)
    assert_one_line_naming(error, labels_path, "label 10 at index 1")

    int_labels = write(tmp_path / "intlabels", idx_bytes(np.zeros(3, np.int32)))
    with pytest.raises(DatasetError) as error:
        load_mnist(images_path, int_labels)
    assert_one_line_naming(error, int_labels, "unsigned-byte labels")

    small = write(tmp_path / "small", idx_bytes(np.zeros((3, 14, 14), np.uint8)))
    with pytest.raises(DatasetError) as error:
        load_mnist(small, labels_path)
    assert_one_line_naming(error, small, "28x28", "14x14")

    flat = write(tmp_path / "flat", idx_bytes(np.zeros((3, 784), np.uint8)))
    with pytest.raises(DatasetError) as error:
        load_mnist(flat, labels_path)
    assert_one_line_naming(error, flat, "(3, 784)")


# CIFAR-10

def test_load_cifar10_round_trips_channels_last(tmp_path: Path) -> None:
    images, labels = cifar_data(3, 1)
    path = write(tmp_path / "data_batch_1.bin", cifar_bytes(images, labels))
    x, y = load_cifar10([path])
    assert x.shape == (3, 32, 32, 3) and x.dtype == np.float32
    assert y.shape == (3,) and y.dtype == np.int64
    np.testing.assert_array_equal(x, images.astype(np.float32) / 255)
    np.testing.assert_array_equal(y, labels)
    assert x.min() >= 0.0 and x.max() <= 1.0


def test_cifar10_red_plane_is_channel_0(tmp_path: Path) -> None:
    # One record by hand: label 7, R plane all 255, G plane 0..., B plane 51, with
    # pixel (row 1, column 2) of the G plane marked.
    green = np.zeros(1024, np.uint8)
    green[1 * 32 + 2] = 102
    record = bytes([7]) + bytes([255] * 1024) + green.tobytes() + bytes([51] * 1024)
    path = write(tmp_path / "one.bin", record)
    x, y = load_cifar10(str(path))
    assert y.tolist() == [7]
    assert (x[0, ..., 0] == 1.0).all()
    assert (x[0, ..., 2] == np.float32(51) / 255).all()
    assert x[0, 1, 2, 1] == np.float32(102) / 255
    assert np.count_nonzero(x[0, ..., 1]) == 1


def cifar_directory(tmp_path: Path) -> dict[str, tuple[npt.NDArray[np.uint8],
                                                       npt.NDArray[np.uint8]]]:
    batches = {name: cifar_data(2, seed) for seed, name in enumerate(
        ["data_batch_2.bin", "data_batch_1.bin", "data_batch_10.bin", "test_batch.bin"])}
    for name, (images, labels) in batches.items():
        write(tmp_path / name, cifar_bytes(images, labels))
    write(tmp_path / "batches.meta.txt", b"airplane\nautomobile\n")
    return batches


def test_load_cifar10_directory(tmp_path: Path) -> None:
    batches = cifar_directory(tmp_path)
    x, y = load_cifar10(tmp_path)
    order = ["data_batch_1.bin", "data_batch_2.bin", "data_batch_10.bin"]
    np.testing.assert_array_equal(
        x, np.concatenate([batches[n][0] for n in order]).astype(np.float32) / 255)
    np.testing.assert_array_equal(y, np.concatenate([batches[n][1] for n in order]))

    x, y = load_cifar10(str(tmp_path), train=False)
    assert x.shape == (2, 32, 32, 3)
    np.testing.assert_array_equal(y, batches["test_batch.bin"][1])


def test_load_cifar10_list_keeps_order(tmp_path: Path) -> None:
    batches = cifar_directory(tmp_path)
    names = ["test_batch.bin", "data_batch_1.bin"]
    _, y = load_cifar10([str(tmp_path / n) for n in names])
    np.testing.assert_array_equal(y, np.concatenate([batches[n][1] for n in names]))


def test_load_cifar10_gzip(tmp_path: Path) -> None:
    images, labels = cifar_data(2, 3)
    path = write(tmp_path / "data_batch_1.bin", cifar_bytes(images, labels), compress=True)
    x, _ = load_cifar10(path)
    np.testing.assert_array_equal(x, images / np.float32(255))


def test_load_cifar10_rejects_malformed_files(tmp_path: Path) -> None:
    images, labels = cifar_data(2, 4)
    good = cifar_bytes(images, labels)

    cut = write(tmp_path / "data_batch_1.bin", good[:-1])
    with pytest.raises(DatasetError) as error:
        load_cifar10([cut])
    assert_one_line_naming(error, cut, str(len(good) - 1), "3073-byte")

    labels[1] = 10
    bad_label = write(tmp_path / "data_batch_2.bin", cifar_bytes(images, labels))
    with pytest.raises(DatasetError) as error:
        load_cifar10(bad_label)
    assert_one_line_naming(error, bad_label, "label 10 at index 1")

    empty = write(tmp_path / "empty.bin", b"")
    with pytest.raises(DatasetError) as error:
        load_cifar10(empty)
    assert_one_line_naming(error, empty, "empty")

    missing = tmp_path / "data_batch_9.bin"
    with pytest.raises(DatasetError) as error:
        load_cifar10([missing])
    assert_one_line_naming(error, missing, "No such file")

    with pytest.raises(DatasetError, match="no CIFAR-10 files"):
        load_cifar10([])


def test_load_cifar10_directory_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as error:
        load_cifar10(tmp_path)
    assert_one_line_naming(error, tmp_path, "data_batch_")
    with pytest.raises(DatasetError) as error:
        load_cifar10(tmp_path, train=False)
    assert_one_line_naming(error, tmp_path / "test_batch.bin", "No such file")


def test_messages_stay_one_line_for_odd_names(tmp_path: Path) -> None:
    path = write(tmp_path / "two\nlines", b"\0\0\x07\x00")
    with pytest.raises(DatasetError) as error:
        read_idx(path)
    assert "\n" not in str(error.value)


# synthetic and Batches

def test_synthetic_is_deterministic_per_seed() -> None:
    x, y = synthetic((28, 28, 1), 64, 10, seed=3)
    assert x.shape == (64, 28, 28, 1) and x.dtype == np.float32
    assert y.shape == (64,) and y.dtype == np.int64
    assert y.min() >= 0 and y.max() < 10 and len(np.unique(y)) > 1
    assert abs(float(x.mean())) < 0.1 and 0.9 < float(x.std()) < 1.1
    x2, y2 = synthetic((28, 28, 1), 64, 10, seed=3)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    x3, _ = synthetic((28, 28, 1), 64, 10, seed=4)
    assert not np.array_equal(x, x3)
    with pytest.raises(ValueError, match="classes"):
        synthetic((3,), 4, 0, seed=0)


def test_batches_cycle_and_reshuffle_deterministically() -> None:
    inputs = np.arange(10, dtype=np.float32)[:, None] * np.ones(3, np.float32)
    labels = np.arange(10, dtype=np.int64)
    batches = Batches(inputs, labels, 4, seed=7)
    seen = [next(batches) for _ in range(5)]  # 20 samples: two whole epochs
    for x, y in seen:
        assert x.shape == (4, 3) and y.shape == (4,)
        np.testing.assert_array_equal(x[:, 0], y.astype(np.float32))  # pairs stay together
    order = np.concatenate([y for _, y in seen])
    first, second = order[:10], order[10:]
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(10))
    assert not np.array_equal(first, second)  # reshuffled
    assert not np.array_equal(first, labels)  # shuffled from the start
    assert batches.epoch == 2

    again = Batches(inputs, labels, 4, seed=7)
    np.testing.assert_array_equal(
        np.concatenate([next(again)[1] for _ in range(5)]), order)
    other = Batches(inputs, labels, 4, seed=8)
    assert not np.array_equal(np.concatenate([next(other)[1] for _ in range(5)]), order)


def test_batches_larger_than_dataset_and_unshuffled() -> None:
    labels = np.arange(3, dtype=np.int64)
    batches = Batches(labels.astype(np.float32), labels, 7, seed=0, shuffle=False)
    x, y = next(batches)
    assert y.tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert x.dtype == np.float32
    assert next(iter(batches))[1].tolist() == [1, 2, 0, 1, 2, 0, 1]
    with pytest.raises(ValueError, match="labels"):
        Batches(labels, labels[:2], 2, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        Batches(labels, labels, 0, seed=0)
