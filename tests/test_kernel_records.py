"""Decoding raw CUPTI activity buffers in bulk, naming kernels, and aggregating
them: synthetic buffers in CUPTI's own record layouts, no GPU needed."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest

from dlprof_agent.probe import kernel_names as kn
from dlprof_agent.probe import kernel_records as kr
from dlprof_agent.probe import kernel_totals as ktot
from tests.cupti_records import (
    CUSTOM0,
    DRIVER,
    DTOD,
    DTOH,
    HTOD,
    HTOH,
    LAYOUTS,
    PTOP,
    BufferBuilder,
)

VERSIONS = sorted(LAYOUTS)
GEMM = "_Z17gemm_kernel_tiledILi128ELi64EEvPKfS1_Pfiii"  # void gemm_kernel_tiled<128, 64>(...)
FILL = ("_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEENS_6detail5"
        "ArrayIPcLi1EEEEEviT0_T1_")


def decode(builder: BufferBuilder) -> kr.Batch:
    data = builder.bytes()
    return kr.decode(data, len(data), kr.RecordSplitter(builder.sizes()))


# --- decoding -----------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_field_read_comes_back_from_its_record(version: str) -> None:
    builder = (BufferBuilder(version)
               .kernel("k1", 1_000, 3_500, device=1, stream=13, correlation=77)
               .memcpy(HTOD, 1 << 20, 4_000, 9_000, device=1, stream=14, correlation=78)
               .memset(4096, 9_500, 9_700, device=0, stream=7, correlation=79)
               .overhead(100, 350)
               .external(77, 12345)
               .api(77, start=900, end=1_100))
    batch = decode(builder)

    assert batch.records == 6 and batch.undecoded_bytes == 0
    # Kernels and memsets share the kernel columns, in buffer order; a memset has no name.
    assert batch.kernel_start.tolist() == [1_000, 9_500]
    assert batch.kernel_end.tolist() == [3_500, 9_700]
    assert batch.kernel_device.tolist() == [1, 0]
    assert batch.kernel_stream.tolist() == [13, 7]
    assert batch.kernel_correlation.tolist() == [77, 79]
    assert batch.kernel_name.tolist() == [builder.name_pointer("k1"), 0]
    assert batch.copy_kind.tolist() == [HTOD]
    assert batch.copy_bytes.tolist() == [1 << 20]
    assert (batch.copy_start.tolist(), batch.copy_end.tolist()) == ([4_000], [9_000])
    assert (batch.copy_device.tolist(), batch.copy_stream.tolist()) == ([1], [14])
    assert batch.copy_correlation.tolist() == [78]
    assert batch.overhead_seconds == pytest.approx(250e-9)
    assert (batch.external_correlation.tolist(), batch.external_id.tolist()) == ([77], [12345])
    assert (batch.api_start.tolist(), batch.api_correlation.tolist()) == ([900], [77])


@pytest.mark.parametrize("version", VERSIONS)
def test_any_interleaving_of_kinds_and_sizes_decodes_in_step(version: str) -> None:
    rng = random.Random(version)
    builder = BufferBuilder(version)
    truth = []
    for index in range(3000):
        choice = rng.random()
        if choice < 0.4:
            builder.kernel(f"kernel{index % 7}", index * 10, index * 10 + 5, correlation=index)
            truth.append(("kernel", index))
        elif choice < 0.55:
            builder.external(index, index + 1)
        elif choice < 0.7:
            builder.api(index, kind=rng.choice([5, DRIVER]))
        elif choice < 0.8:
            builder.memcpy(rng.choice([HTOD, DTOH]), index, index, index + 3, correlation=index)
            truth.append(("copy", index))
        elif choice < 0.9:
            builder.memset(8, index, index + 1, correlation=index)
            truth.append(("kernel", index))
        else:
            builder.overhead(index, index + 2)
    batch = decode(builder)

    assert batch.records == builder.count and batch.undecoded_bytes == 0
    assert batch.kernel_correlation.tolist() == [i for kind, i in truth if kind == "kernel"]
    assert batch.copy_correlation.tolist() == [i for kind, i in truth if kind == "copy"]


def test_alternating_short_records_are_found_too() -> None:
    """One external correlation record before each API record: runs of one."""
    builder = BufferBuilder()
    for index in range(500):
        builder.external(index, index).api(index)
    batch = decode(builder)
    assert batch.records == 1000
    assert batch.external_correlation.tolist() == list(range(500))
    assert batch.api_correlation.tolist() == list(range(500))


@pytest.mark.parametrize("version", VERSIONS)
def test_record_sizes_are_learned_from_cupti_one_kind_at_a_time(version: str) -> None:
    builder = BufferBuilder(version).kernel("a", 1, 2).external(1, 1).kernel("b", 3, 4)
    builder.memcpy(DTOH, 8, 5, 6).kernel("c", 7, 8).memcpy(DTOH, 8, 9, 10)
    data = builder.bytes()
    words = np.frombuffer(data, dtype=np.int32)
    asked: list[int] = []

    def learn(offset: int) -> int:
        asked.append(offset)
        return builder.sizes()[int(words[offset // 4])]

    splitter = kr.RecordSplitter()  # as in the probe: no size known beforehand
    batch = kr.decode(data, len(data), splitter, learn)

    assert batch.records == 6 and batch.undecoded_bytes == 0
    assert len(asked) == 3  # once per kind: kernel, external correlation, memcpy
    assert splitter.sizes == {10: builder.sizes()[10], 39: 24, 1: builder.sizes()[1]}
    assert kr.decode(data, len(data), splitter, learn).records == 6
    assert len(asked) == 3


def test_an_unknown_kind_stops_the_walk_there_and_is_counted() -> None:
    builder = BufferBuilder().kernel("a", 1, 2).kernel("b", 3, 4)
    tail = BufferBuilder().kernel("c", 5, 6)
    data = builder.bytes() + np.array([99, 0, 0, 0, 0, 0], dtype=np.int32).tobytes() + \
        tail.bytes()
    splitter = kr.RecordSplitter(builder.sizes())

    batch = kr.decode(data, len(data), splitter)  # nobody to ask its size

    assert batch.records == 2
    assert batch.undecoded_bytes == len(data) - len(builder.bytes())
    learned = kr.decode(data, len(data), kr.RecordSplitter(builder.sizes()), lambda offset: 24)
    assert learned.records == 4 and learned.undecoded_bytes == 0


def test_a_truncated_last_record_is_left_undecoded() -> None:
    builder = BufferBuilder().kernel("a", 1, 2).kernel("b", 3, 4)
    data = builder.bytes()
    batch = kr.decode(data, len(data) - 16, kr.RecordSplitter(builder.sizes()))
    assert batch.records == 1
    assert batch.undecoded_bytes == len(data) - 16 - builder.sizes()[10]


def test_an_empty_buffer_is_no_records() -> None:
    batch = kr.decode(b"", 0, kr.RecordSplitter(BufferBuilder().sizes()))
    assert batch.records == 0 and len(batch.kernel_start) == 0


# --- names --------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "short"), [
    (FILL, "at::native::vectorized_elementwise_kernel"),
    (GEMM, "gemm_kernel_tiled"),
    ("ampere_sgemm_128x64_nn", "ampere_sgemm_128x64_nn"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
     "at::native::(anonymous namespace)::cunn_SoftMaxForward"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>"
     "(cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4::Params)",
     "cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_32x3_nn_align4>"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<"
     "at::native::AddFunctor<float> >(at::TensorIteratorBase&, "
     "at::native::AddFunctor<float> const&)::{lambda(int)#1}>(int, "
     "at::native::gpu_kernel_impl<at::native::AddFunctor<float> >(at::TensorIteratorBase&, "
     "at::native::AddFunctor<float> const&)::{lambda(int)#1})",
     "at::native::elementwise_kernel"),
    ("void foo<(bar)3>(int", "void foo<(bar)3>(int"),  # unbalanced: kept as it came
])
def test_kernel_names_lose_return_type_templates_and_parameters(raw: str, short: str) -> None:
    assert kn.normalize_kernel_name(kn.demangle(raw)) == short


def test_demangling_falls_back_to_the_raw_name() -> None:
    assert kn.demangle("_Znot_a_real_symbol") == "_Znot_a_real_symbol"
    assert kn.demangle("plain_c_kernel") == "plain_c_kernel"
    assert kn.demangle(GEMM).startswith("void gemm_kernel_tiled<128, 64>(")


def test_each_name_pointer_is_read_once() -> None:
    reads: list[int] = []
    strings = {100: FILL.encode(), 200: b"ampere_sgemm_128x64_nn", 300: FILL.encode()}

    def reader(pointer: int) -> bytes:
        reads.append(pointer)
        return strings[pointer]

    names = kn.KernelNames(reader)
    ids = names.full_ids(np.array([100, 200, 100, 0, 300, 100], dtype=np.uint64))
    again = names.full_ids(np.array([200, 100], dtype=np.uint64))

    assert sorted(reads) == [100, 200, 300]
    assert ids.tolist()[0] == ids.tolist()[2] == ids.tolist()[4]  # same symbol, one id
    assert names.full[int(ids[3])] == kn.MEMSET_NAME
    assert again.tolist() == [ids[1], ids[0]]
    assert names.names[names.full_to_name[int(ids[0])]] == \
        "at::native::vectorized_elementwise_kernel"


# --- aggregation --------------------------------------------------------------------


def rows(aggregator: ktot.KernelAggregator) -> dict[tuple[str, int], tuple[int, Any]]:
    return {(name, device): (launches, seconds)
            for name, device, launches, seconds in aggregator.snapshot()["kernels"]}


def test_kernels_are_summed_per_short_name_and_device() -> None:
    builder = BufferBuilder()
    builder.kernel(FILL, 0, 2_000).kernel(FILL, 5_000, 6_000).kernel(FILL, 0, 4_000, device=1)
    builder.kernel("ampere_sgemm_128x64_nn", 0, 30_000).memset(64, 0, 500)
    aggregator = ktot.KernelAggregator()
    aggregator.add(decode(builder), 1.0)

    assert rows(aggregator) == {
        ("at::native::vectorized_elementwise_kernel", 0): (2, pytest.approx(3e-6)),
        ("at::native::vectorized_elementwise_kernel", 1): (1, pytest.approx(4e-6)),
        ("ampere_sgemm_128x64_nn", 0): (1, pytest.approx(30e-6)),
        ("[memset]", 0): (1, pytest.approx(0.5e-6)),
    }


def test_kernels_still_running_at_a_flush_are_never_counted() -> None:
    builder = BufferBuilder().kernel("k", 1_000, 0).kernel("k", 2_000, 2_500)
    aggregator = ktot.KernelAggregator()
    aggregator.add(decode(builder), 1.0)
    assert rows(aggregator) == {("k", 0): (1, pytest.approx(0.5e-6))}
    assert aggregator.snapshot()["incomplete_records"] == 1


def test_durations_fall_in_le_buckets_per_device() -> None:
    builder = BufferBuilder()
    for duration in (500, 1_000, 1_001, 10_000, 2_000_000_000):  # ns
        builder.kernel("k", 1, 1 + duration)
    builder.kernel("k", 1, 1 + 50_000, device=2)
    aggregator = ktot.KernelAggregator()
    aggregator.add(decode(builder), 1.0)
    durations = {device: (counts, total) for device, counts, total in
                 aggregator.snapshot()["durations"]}

    bounds = ktot.DURATION_BUCKETS
    counts, total = durations[0]
    assert len(counts) == len(bounds) + 1
    assert counts[bounds.index(1e-6)] == 2  # 0.5 us and exactly 1 us
    assert counts[bounds.index(2.5e-6)] == 1
    assert counts[bounds.index(1e-5)] == 1
    assert counts[-1] == 1  # 2 s: +Inf
    assert total == pytest.approx((500 + 1_000 + 1_001 + 10_000 + 2_000_000_000) / 1e9)
    assert durations[2][0][bounds.index(5e-5)] == 1


def test_copies_are_summed_per_direction() -> None:
    builder = BufferBuilder()
    builder.memcpy(HTOD, 1000, 0, 1_000).memcpy(HTOD, 3000, 0, 2_000)
    builder.memcpy(DTOH, 10, 0, 10).memcpy(DTOD, 20, 0, 20).memcpy(PTOP, 30, 0, 30, device=1)
    builder.memcpy(HTOH, 40, 0, 40).memcpy(0, 50, 0, 50).memcpy(HTOD, 5, 100, 0)
    aggregator = ktot.KernelAggregator()
    aggregator.add(decode(builder), 1.0)
    copies = {(device, kind): (copied, seconds) for device, kind, copied, seconds in
              aggregator.snapshot()["memcpy"]}
    assert copies == {(0, "h2d"): (4000, pytest.approx(3e-6)),
                      (0, "d2h"): (10, pytest.approx(1e-8)),
                      (0, "d2d"): (20, pytest.approx(2e-8)),
                      (1, "p2p"): (30, pytest.approx(3e-8)),
                      (0, "h2h"): (40, pytest.approx(4e-8)),
                      (0, "other"): (50, pytest.approx(5e-8))}


def test_cupti_overhead_is_summed() -> None:
    aggregator = ktot.KernelAggregator()
    aggregator.add(decode(BufferBuilder().overhead(0, 1_000).overhead(10, 510)), 1.0)
    aggregator.add(decode(BufferBuilder().overhead(0, 500)), 1.0)
    assert aggregator.snapshot()["overhead_seconds"] == pytest.approx(2e-6)


def test_the_top_kernels_keep_their_names_and_the_rest_is_other() -> None:
    builder = BufferBuilder()
    for index in range(250):
        builder.kernel(f"kernel_{index:03}", 0, 1_000 + index)
    aggregator = ktot.KernelAggregator(max_kernels=200)
    aggregator.add(decode(builder), 1.0)
    table = rows(aggregator)

    assert len(table) == 201
    assert table[("other", 0)][0] == 50
    assert sum(s for _, s in table.values()) == pytest.approx(
        sum(1_000 + i for i in range(250)) / 1e9)


def test_capped_counters_stay_monotonic_as_the_top_kernels_change() -> None:
    """Autotuning kernels of the warm-up give way to the steady state's."""
    aggregator = ktot.KernelAggregator(max_kernels=4)
    warmup = BufferBuilder()
    for index in range(4):
        warmup.kernel(f"autotune_{index}", 0, 1_000)
    aggregator.add(decode(warmup), 1.0)
    before = rows(aggregator)

    steady = BufferBuilder()
    for _ in range(20):
        steady.kernel("conv_fwd", 0, 100_000).kernel("gemm", 0, 50_000)
    seen = [before]
    for _ in range(30):  # 30 batches, 10 s apart: the warm-up's time decays away
        aggregator.add(decode(steady), 10.0)
        seen.append(rows(aggregator))
    after = seen[-1]

    assert ("conv_fwd", 0) in after and ("gemm", 0) in after
    assert len(after) <= 5
    for earlier, later in itertools.pairwise(seen):
        for key, (launches, seconds) in later.items():
            if key in earlier:  # a series that goes on never goes back
                assert launches >= earlier[key][0]
                assert seconds >= earlier[key][1] - 1e-12
    total = 4 * 1e-6 + 30 * 20 * (100e-6 + 50e-6)
    # Time before a promotion went to other: the sum over every series ever shown.
    assert sum(s for _, s in after.values()) <= total + 1e-9
    assert after[("other", 0)][1] > 0


def layer_ids(labels: list[str], max_layers: int = 512) -> ktot.LayerIds:
    return ktot.LayerIds(5 << 24, labels, max_layers)


def test_kernel_time_goes_to_the_layer_and_phase_that_launched_it() -> None:
    base = 5 << 24
    builder = BufferBuilder()
    builder.external(1, base | 0 << 1).api(1).kernel("conv", 0, 1_000, correlation=1)
    builder.external(2, base | 1 << 1).api(2).kernel("relu", 0, 200, correlation=2)
    builder.external(3, base | 0 << 1 | 1).api(3).kernel("conv_bwd", 0, 3_000, correlation=3)
    builder.external(4, 999, external_kind=CUSTOM0).kernel("kineto", 0, 50, correlation=4)
    builder.external(5, (6 << 24) | 2).kernel("stale_generation", 0, 70, correlation=5)
    builder.kernel("optimizer", 0, 400, correlation=6)
    aggregator = ktot.KernelAggregator()
    aggregator.layer_ids = layer_ids(["features.0", "features.1"])
    aggregator.add(decode(builder), 1.0)

    layers = {(label, phase): s for label, phase, s in aggregator.snapshot()["layers"]}
    assert layers == {("features.0", "forward"): pytest.approx(1e-6),
                      ("features.1", "forward"): pytest.approx(0.2e-6),
                      ("features.0", "backward"): pytest.approx(3e-6)}


def test_a_timed_steps_kernel_time_counts_for_the_steps_it_stands_for() -> None:
    base = 5 << 24
    builder = BufferBuilder()
    builder.external(1, 7 << ktot.WEIGHT_SHIFT | base | 0 << 1).kernel("conv", 0, 1_000,
                                                                     correlation=1)
    builder.external(2, 1 << ktot.WEIGHT_SHIFT | base | 1 << 1 | 1).kernel("relu_bwd", 0, 200,
                                                                         correlation=2)
    builder.external(3, 7 << ktot.WEIGHT_SHIFT | (6 << 24) | 0).kernel("stale", 0, 70,
                                                                     correlation=3)
    aggregator = ktot.KernelAggregator()
    aggregator.layer_ids = layer_ids(["features.0", "features.1"])
    aggregator.add(decode(builder), 1.0)
    layers = {(label, phase): s for label, phase, s in aggregator.snapshot()["layers"]}
    assert layers == {("features.0", "forward"): pytest.approx(7e-6),
                      ("features.1", "backward"): pytest.approx(0.2e-6)}
    kernels = {name: seconds for name, _, _, seconds in aggregator.snapshot()["kernels"]}
    assert kernels["conv"] == pytest.approx(1e-6)  # kernel totals are what ran, unweighted


def test_a_kernel_whose_launch_record_comes_a_buffer_later_is_still_attributed() -> None:
    base = 5 << 24
    aggregator = ktot.KernelAggregator()
    aggregator.layer_ids = layer_ids(["fc"])
    aggregator.add(decode(BufferBuilder().kernel("gemm", 0, 2_000, correlation=10)), 1.0)
    assert aggregator.snapshot()["layers"] == []
    aggregator.add(decode(BufferBuilder().external(10, base | 0).api(10)), 1.0)
    assert aggregator.snapshot()["layers"] == [["fc", "forward", pytest.approx(2e-6)]]


def test_layers_past_the_cap_are_other() -> None:
    base = 5 << 24
    builder = BufferBuilder().external(1, base | 3 << 1).kernel("k", 0, 1_000, correlation=1)
    aggregator = ktot.KernelAggregator()
    aggregator.layer_ids = layer_ids(["a", "b", "c", "d"], max_layers=2)
    aggregator.add(decode(builder), 1.0)
    assert aggregator.snapshot()["layers"] == [["other", "forward", pytest.approx(1e-6)]]


def test_a_name_pointer_outside_readable_memory_is_never_dereferenced() -> None:
    names = kn.KernelNames()  # the real reader, as in the probe
    builder = BufferBuilder()
    good = builder.name_pointer(GEMM)
    ids = names.full_ids(np.array([good, 8, 0xFFFF_FFFF_FFF0], dtype=np.uint64))
    assert names.full[int(ids[0])].startswith("void gemm_kernel_tiled<128, 64>")
    assert names.full[int(ids[1])] == "unreadable@0x8"
    assert names.full[int(ids[2])].startswith("unreadable@")
