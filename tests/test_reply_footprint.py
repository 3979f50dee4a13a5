"""What a wide reply costs the agent: rows past the target's series budget are
folded before any per-row object is built (probe_link/reply_rows.py), with the
same result as folding them after and the drops counted; every value is still
checked; a reply larger than a pass's byte budget is decoded only every few
passes (probe_link/reply_pacing.py), while a ResNet-sized one is decoded every
pass; and what a sample kept from one pass to the next renders is built and
written once (exporters/prometheus.py, exporters/text.py)."""

from __future__ import annotations

import dataclasses
import math
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from dlprof_agent.errors import ProtocolError
from dlprof_agent.exporters import prometheus
from dlprof_agent.exporters.probe_families import probe_families
from dlprof_agent.exporters.text import render_text
from dlprof_agent.model.snapshot import NodeSnapshot
from dlprof_agent.probe import protocol
from dlprof_agent.probe.messages import OTHER
from dlprof_agent.probe.protocol import MAX_REQUEST_BYTES, encode, read_frame
from dlprof_agent.probe_link import reply_pacing
from dlprof_agent.probe_link.client import ProbeClient, ReplyLate
from dlprof_agent.probe_link.samples import ProbeSample
from dlprof_agent.probe_link.series_budget import SeriesBudget, fold, probe_series
from tests.full_snapshot import full_snapshot
from tests.test_probe_channel_bounds import real_reply
from tests.test_series_budget import rendered_series, wide_reply

BUDGET = 5_000


def same_rows(ours: tuple[Any, ...], theirs: tuple[Any, ...]) -> bool:
    """Equal, but for the order floating-point sums were taken in."""
    if len(ours) != len(theirs):
        return False
    for mine, other in zip(ours, theirs, strict=True):
        for a, b in zip(mine.__slots__, other.__slots__, strict=True):
            x, y = getattr(mine, a), getattr(other, b)
            if isinstance(x, float) and not math.isclose(x, y, rel_tol=1e-9):
                return False
            if not isinstance(x, float) and x != y:
                return False
    return True


def test_rows_past_the_budget_are_folded_before_they_are_built_as_the_budget_would() -> None:
    reply = wide_reply(kernels=6_000, devices=3)
    whole = ProbeSample.from_reply(1, reply)
    cut = ProbeSample.from_reply(1, reply, max_series=BUDGET)
    assert cut.kernels is not None and whole.kernels is not None
    # Each family holds no more rows than the budget alone could keep, and other.
    assert len(cut.layers) <= BUDGET // 4 + 1 < len(whole.layers)
    assert len(cut.kernels.kernels) <= BUDGET // 2 + 3 < len(whole.kernels.kernels)
    assert cut.layers[-1].name == OTHER
    # The families share the budget, as the fold shares it: together they keep
    # about the budget's worth of rows, not a budget's worth each.
    assert 4 * len(cut.layers) + 2 * len(cut.kernels.kernels) <= BUDGET + 4 + 2 * 3
    assert sum(k.launches for k in cut.kernels.kernels) == sum(
        k.launches for k in whole.kernels.kernels)
    assert cut.series_folded == probe_series(whole) - probe_series(cut) > 0
    # Folded to the budget, the cut reply gives what the whole one gives.
    ours, theirs = fold(cut, BUDGET), fold(whole, BUDGET)
    assert ours.kernels is not None and theirs.kernels is not None
    assert same_rows(ours.layers, theirs.layers)
    assert same_rows(ours.kernels.kernels, theirs.kernels.kernels)
    assert ours.series_folded == theirs.series_folded


def test_the_series_folded_before_the_rows_were_built_are_counted() -> None:
    reply = wide_reply(kernels=4_000)
    budget = SeriesBudget(per_target=BUDGET)
    whole = budget.fold([(ProbeSample.from_reply(1, reply), 116)])[0]
    counted = dict(budget.dropped())["target_budget"]
    cut_budget = SeriesBudget(per_target=BUDGET)
    cut = cut_budget.fold([(ProbeSample.from_reply(1, reply, max_series=BUDGET), 116)])[0]
    assert whole is not None and cut is not None
    assert dict(cut_budget.dropped())["target_budget"] == counted > 11_000
    assert probe_series(cut) == probe_series(whole) <= BUDGET


def resnet_reply() -> dict[str, Any]:
    """About what a ResNet-50 with --layers and kernels sends."""
    reply = real_reply(layers=160)
    reply["kernels"] = {"state": "active", "reason": "", "kernels": [
        [f"void cudnn::conv_kernel_{i}", 0, 10, 0.001 * (i + 1)] for i in range(300)],
        "layers": [[f"features.{i}", phase, 0.001] for i in range(160)
                   for phase in ("forward", "backward")], "memcpy": [], "durations": []}
    return reply


def test_a_resnet_sized_reply_is_kept_as_sent() -> None:
    reply = resnet_reply()
    assert ProbeSample.from_reply(1, reply, max_series=BUDGET) == ProbeSample.from_reply(
        1, reply)


@pytest.mark.parametrize("column, value", [
    (1, -1.0), (1, float("nan")), (1, float("inf")), (2, True), (2, -1), (2, 1.5),
    (0, "x" * 600), (0, None)])
def test_a_bad_value_in_a_row_past_the_budget_still_refuses_the_reply(
        column: int, value: object) -> None:
    reply = wide_reply()
    layers = reply["probe"]["layers"]  # type: ignore[index]
    layers[0][column] = value  # the shortest layer: folded, never built
    with pytest.raises(ProtocolError):
        ProbeSample.from_reply(1, reply, max_series=BUDGET)


class FakeProbe:
    """Answers each snapshot request on ``server`` with ``reply(n)``, n from 1."""

    def __init__(self, server: socket.socket, reply: Callable[[int], dict[str, Any]]) -> None:
        self.requests = 0
        self.answer = threading.Event()
        self.answer.set()
        self._server, self._reply = server, reply
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                read_frame(self._server, max_bytes=MAX_REQUEST_BYTES)
            except Exception:
                return
            self.requests += 1
            self.answer.wait()
            self._server.sendall(encode(self._reply(self.requests)))


def with_steps(reply: dict[str, Any], steps: int) -> dict[str, Any]:
    return {**reply, "probe": {**reply["probe"], "steps": {"steady": steps}}}


@pytest.fixture
def client_and_probe(request: pytest.FixtureRequest) -> Iterator[tuple[ProbeClient, FakeProbe]]:
    reply: dict[str, Any] = request.param
    ours, theirs = socket.socketpair()
    ours.settimeout(10.0)
    with ours, theirs:
        probe = FakeProbe(theirs, lambda n: with_steps(reply, n))
        yield ProbeClient(1, ours, {}, layers=True), probe


@pytest.mark.parametrize("client_and_probe", [wide_reply(kernels=4_000)], indirect=True)
def test_a_reply_past_the_byte_budget_is_decoded_every_few_passes_and_asked_for_every_pass(
        client_and_probe: tuple[ProbeClient, FakeProbe]) -> None:
    client, probe = client_and_probe
    first = client.snapshot()
    every = math.ceil(first.reply_row_bytes / reply_pacing.REPLY_BYTES_PER_PASS)
    assert every >= 3  # a 4,096-layer tenant of 510-character names: 2.9 MB
    steps, asked = [first.steady_steps], [probe.requests]
    for _ in range(2 * every):
        steps.append(client.snapshot().steady_steps)
        asked.append(probe.requests)
    # Decoded every `every` passes; the last decoded stands between, and stands
    # for the replies of the probe that were dropped undecoded.
    decoded = sorted(set(steps))
    assert steps == [decoded[0]] * every + [decoded[1]] * every + [decoded[2]]
    assert decoded[1] - decoded[0] == decoded[2] - decoded[1] == (every + 1) // 2
    # The probe hears from us at least every other pass: its lease holds.
    passes_asked = [i for i in range(1, len(asked)) if asked[i] > asked[i - 1]]
    assert all(b - a <= reply_pacing.ASK_EVERY_PASSES
               for a, b in zip([0, *passes_asked], passes_asked, strict=False))
    assert asked[-1] < len(asked)  # but not every pass
    # A held pass gives the same sample, so what is built from it can be kept.
    assert client.snapshot() is client.snapshot()
    # The passes held are counted on the next sample decoded.
    assert [client.snapshot().replies_held for _ in range(every)][-1] == 3 * (every - 1)


@pytest.mark.parametrize("client_and_probe", [resnet_reply()], indirect=True)
def test_a_resnet_sized_reply_is_decoded_every_pass(
        client_and_probe: tuple[ProbeClient, FakeProbe]) -> None:
    client, _ = client_and_probe
    assert [client.snapshot().steady_steps for _ in range(5)] == [1, 2, 3, 4, 5]
    assert client.pacing.held_total == 0


@pytest.mark.parametrize("client_and_probe", [wide_reply()], indirect=True)
def test_a_reply_to_drop_that_comes_late_is_taken_off_whole_and_the_next_is_read(
        client_and_probe: tuple[ProbeClient, FakeProbe]) -> None:
    client, probe = client_and_probe
    assert client.snapshot().steady_steps == 1
    probe.answer.clear()
    client.set_timeout(0.2)
    for _ in range(reply_pacing.ASK_EVERY_PASSES - 1):  # passes that ask nothing
        assert client.snapshot().steady_steps == 1
    assert probe.requests == 1
    with pytest.raises(ReplyLate):  # the pass that asks, its reply held up
        client.snapshot()
    probe.answer.set()
    client.set_timeout(10.0)
    assert client.snapshot().steady_steps == 1  # the late reply, dropped: still held
    # The stream is still in step: the next reply decoded is a later one, whole.
    steps = [client.snapshot().steady_steps for _ in range(40)]
    assert max(steps) > 2 and probe.requests > 2


def test_a_probe_sample_kept_from_one_scrape_to_the_next_is_built_once_and_written_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []

    def counted(pid: int, *args: Any) -> list[Metric]:
        built.append(pid)
        return probe_families(pid, *args)

    monkeypatch.setattr(prometheus, "probe_families", counted)
    first, second = full_snapshot(100), full_snapshot(200)
    node = NodeSnapshot(timestamp_seconds=1.0, monotonic_seconds=1.0, host=first.host,
                        gpu=first.gpu, targets=(first, second), agent=first.agent)
    registry = CollectorRegistry()
    registry.register(prometheus.NodeCollector(lambda: node, interval_seconds=1.0))
    written = [render_text(registry) for _ in range(3)]
    # Merging the two targets' families leaves the kept ones as they were.
    assert written[0] == written[1] == written[2] == generate_latest(registry)
    assert sorted(built) == [100, 200]
    # A new sample of one target is built and written anew; the other is kept.
    assert first.probe is not None
    stepped = dataclasses.replace(first.probe, steps=(("steady", 12345),))
    node = dataclasses.replace(node, targets=(dataclasses.replace(first, probe=stepped),
                                              second))
    assert render_text(registry) == generate_latest(registry)
    assert b'phase="steady",pid="100",rank="0"} 12345.0' in render_text(registry)
    assert sorted(built) == [100, 100, 200]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([b'"', b"[", b"]", b"{", b"}", b",", b":", b"a", b"\\", b"1"]),
                max_size=60).map(b"".join))
def test_strings_are_blanked_as_the_pattern_blanks_them(payload: bytes) -> None:
    assert protocol.blank_strings(payload) == protocol._STRING.sub(b'""', payload)


def test_the_passes_a_sample_stood_in_for_are_exported() -> None:
    sample = dataclasses.replace(ProbeSample.from_reply(1, resnet_reply()), replies_held=7)
    assert 'dlprof_probe_replies_held_total{pid="1"} 7.0' in rendered_series(
        probe_families(1, True, sample))
