"""The step split of the PyTorch hooks on real training loops in this process:
phases that are disjoint (an optimizer's closure runs forward and backward
inside its step), that sum to the step time over any window of steps while
layer timing is duty-cycled, and samples found where Hugging Face's Trainer
puts its batch (keyword arguments, a dict of tensors)."""

from __future__ import annotations

from collections import UserDict
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from dlprof_agent.probe.recorder import LayerSampling, Recorder  # noqa: E402
from dlprof_agent.probe.torch_hooks import TorchHooks  # noqa: E402
from dlprof_agent.workloads.torch_models import small_cnn  # noqa: E402

pytestmark = pytest.mark.slow

BATCH = 8
WARMUP = 2
WINDOW_STEPS = 4  # a window shorter than the duty cycle's first interval (8)
WINDOWS = 6
SUM_TOLERANCE = 0.01  # the phases' sum against the steps' time, over any window

Step = Callable[[], None]
Module: Any = torch.nn.Module


def attach(*, layers: bool = True, split: bool = True) -> tuple[Recorder, TorchHooks]:
    # As the agent sets it up: duty-cycled layer timing under the default budget.
    recorder = Recorder(warmup_steps=WARMUP,
                        layer_sampling=LayerSampling() if layers else None)
    recorder.split = split
    hooks = TorchHooks(recorder, layers=layers, split=split)
    hooks.install()
    return recorder, hooks


def phase_windows(recorder: Recorder, step: Step) -> list[tuple[dict[str, float], float]]:
    """Each window's phase seconds and step seconds, from snapshots taken
    every WINDOW_STEPS steps after the warm-up, as an agent's scrapes would."""
    for _ in range(WARMUP + 2):
        step()
    windows = []
    before = recorder.snapshot()
    for _ in range(WINDOWS):
        for _ in range(WINDOW_STEPS):
            step()
        after = recorder.snapshot()
        phases = {phase: seconds - before["phase_seconds"].get(phase, 0.0)
                  for phase, seconds in after["phase_seconds"].items()}
        windows.append((phases, after["step_seconds_sum"] - before["step_seconds_sum"]))
        before = after
    return windows


def assert_windows_add_up(windows: list[tuple[dict[str, float], float]]) -> None:
    for phases, step_seconds in windows:
        assert step_seconds > 0
        assert min(phases.values()) >= 0, phases
        assert sum(phases.values()) == pytest.approx(step_seconds, rel=SUM_TOLERANCE), (
            phases, step_seconds)


def totals(windows: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    summed: dict[str, float] = {}
    for phases, _ in windows:
        for phase, seconds in phases.items():
            summed[phase] = summed.get(phase, 0.0) + seconds
    return summed


def cnn_batch() -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    return small_cnn(), torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))


def test_a_closure_counts_as_forward_and_backward_not_as_the_optimizer() -> None:
    """Lightning's automatic optimization: optimizer.step(closure), the closure
    running zero_grad, forward, the loss and backward."""
    model, images, labels = cnn_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def closure() -> Any:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        return loss

    recorder, hooks = attach()
    try:
        windows = phase_windows(recorder, lambda: optimizer.step(closure))
    finally:
        hooks.remove()
    assert_windows_add_up(windows)
    phases = totals(windows)
    # The update of 137k parameters is a small part of the step, far below the
    # forward and backward of a CNN on a batch of images.
    assert phases["optimizer"] < phases["forward"] < phases["forward"] + phases["backward"]
    assert phases["optimizer"] < 0.2 * sum(phases.values())
    assert recorder.snapshot()["phase_split"] == "split"


class WordModel(Module):  # type: ignore[misc]
    """pytorch/examples' word_language_model: the hidden state goes in and
    comes out with the logits."""

    def __init__(self, vocabulary: int = 500, hidden: int = 64) -> None:
        super().__init__()
        self.encoder = torch.nn.Embedding(vocabulary, hidden)
        self.drop = torch.nn.Dropout(0.2)
        self.rnn = torch.nn.LSTM(hidden, hidden, num_layers=2)
        self.decoder = torch.nn.Linear(hidden, vocabulary)

    def forward(self, ids: Any, hidden: Any) -> tuple[Any, Any]:
        output, hidden = self.rnn(self.drop(self.encoder(ids)), hidden)
        return self.decoder(self.drop(output)), hidden


def test_a_manual_sgd_loop_without_torch_optim_splits_to_the_step_time() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    vocabulary, length = 500, 20
    model = WordModel(vocabulary)
    ids = torch.randint(0, vocabulary, (length + 1, BATCH))
    hidden = [tuple(torch.zeros(2, BATCH, 64) for _ in range(2))]

    def step() -> None:
        model.zero_grad()
        state = tuple(h.detach() for h in hidden[0])  # repackage_hidden
        output, hidden[0] = model(ids[:-1], state)
        loss = torch.nn.functional.cross_entropy(output.view(-1, vocabulary),
                                                 ids[1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for parameter in model.parameters():
            parameter.data.add_(parameter.grad, alpha=-0.1)

    recorder, hooks = attach()
    try:
        windows = phase_windows(recorder, step)
    finally:
        hooks.remove()
    snapshot = recorder.snapshot()
    assert snapshot["step_source"] == "forward"
    # Its input is (sequence, batch): the batch is dimension 1, not the 20 tokens.
    assert snapshot["samples"] == {phase: BATCH * steps
                                   for phase, steps in snapshot["steps"].items()}
    assert_windows_add_up(windows)
    phases = totals(windows)
    assert phases["forward"] > 0 and phases["backward"] > 0 and "optimizer" not in phases
    assert snapshot["phase_split"] == "split"
    # Since the start too: what the summary divides.
    assert sum(snapshot["phase_seconds"].values()) == pytest.approx(
        snapshot["step_seconds_sum"], rel=SUM_TOLERANCE)


def test_an_optimizer_loop_with_duty_cycled_layers_splits_every_window() -> None:
    """The imagenet example's loop: zero_grad, forward, backward, SGD with momentum."""
    model, images, labels = cnn_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                                weight_decay=1e-4)

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()

    recorder, hooks = attach()
    try:
        windows = phase_windows(recorder, step)
    finally:
        hooks.remove()
    assert_windows_add_up(windows)
    phases = totals(windows)
    assert {"forward", "backward", "optimizer", "other"} <= set(phases)
    assert recorder.snapshot()["layer_sampled_steps"] < WINDOWS * WINDOW_STEPS


def closure_training() -> Step:
    model, images, labels = cnn_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def closure() -> Any:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        return loss

    return lambda: optimizer.step(closure)


def test_without_layer_timing_every_step_is_split() -> None:
    recorder, hooks = attach(layers=False)
    try:
        windows = phase_windows(recorder, closure_training())
    finally:
        hooks.remove()
    assert_windows_add_up(windows)
    phases = totals(windows)
    assert {"forward", "backward", "optimizer", "other"} == set(phases)
    assert phases["optimizer"] < phases["forward"] + phases["backward"]  # not the closure's
    assert recorder.snapshot()["phase_split"] == "split"
    assert not recorder.snapshot()["layers"] and not hooks.layer_labels  # no layer hooked


def test_with_the_split_off_no_phase_is_timed_and_the_split_says_so() -> None:
    from torch import distributed

    all_reduce = distributed.all_reduce
    recorder, hooks = attach(layers=False, split=False)
    try:
        assert distributed.all_reduce is all_reduce  # no collective wrapped
        windows = phase_windows(recorder, closure_training())
    finally:
        hooks.remove()
    assert_windows_add_up(windows)
    assert set(totals(windows)) == {"unsplit"}
    assert recorder.snapshot()["phase_split"] == "not split: turned off"


class TinyLanguageModel(Module):  # type: ignore[misc]
    """A Hugging Face model's interface: keyword inputs, the loss computed
    inside when labels are given, and a dict of outputs."""

    def __init__(self, vocabulary: int = 100, hidden: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocabulary, hidden)
        self.head = torch.nn.Linear(hidden, vocabulary)

    def forward(self, input_ids: Any, attention_mask: Any = None,
                labels: Any = None) -> dict[str, Any]:
        logits = self.head(self.embed(input_ids))
        out = {"logits": logits}
        if labels is not None:
            out = {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                             labels.flatten()), **out}
        return out


class BatchEncoding(UserDict[str, Any]):
    """As transformers' BatchEncoding: a UserDict of tensors."""


class DictInputs(Module):  # type: ignore[misc]
    """A model called with the batch's dict itself, as some loops do."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: Any) -> Any:
        return self.model(**inputs)


@pytest.mark.parametrize("call", ["keywords", "dict"])
def test_samples_are_found_in_keyword_and_dict_inputs(call: str) -> None:
    torch.manual_seed(0)
    model = TinyLanguageModel() if call == "keywords" else DictInputs(TinyLanguageModel())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (BATCH, 12))
    batch = BatchEncoding(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)

    def step() -> None:
        # The Trainer's training_step: model(**inputs), the loss from the outputs.
        outputs = model(**batch) if call == "keywords" else model(batch)
        outputs["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()

    recorder, hooks = attach()
    try:
        windows = phase_windows(recorder, step)
    finally:
        hooks.remove()
    snapshot = recorder.snapshot()
    assert snapshot["samples"]["steady"] == BATCH * snapshot["steps"]["steady"] > 0
    # The loss in the outputs' dict is where backward begins.
    assert_windows_add_up(windows)
    assert totals(windows)["backward"] > 0
    assert snapshot["phase_split"] == "split"


def test_torch_profiler_sees_the_same_ops_with_the_default_split_hooks() -> None:
    """The split's hooks (on by default) call no operator: the job's own profiler
    records what it records without the probe, op for op."""
    model, images, labels = cnn_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def profiled() -> dict[str, int]:
        def step() -> None:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()

        for _ in range(WARMUP + 2):
            step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as run:
            for _ in range(3):
                step()
        return {event.key: event.count for event in run.key_averages()}

    without = profiled()
    recorder, hooks = attach(layers=False)
    try:
        with_split = profiled()
    finally:
        hooks.remove()
    assert recorder.snapshot()["phase_split"] == "split"  # the hooks were in
    assert with_split == without
