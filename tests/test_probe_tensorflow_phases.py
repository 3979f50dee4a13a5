"""The step split of the TensorFlow hooks against real Keras 3 on the CPU:
backward (``GradientTape.gradient``) and the optimizer's apply are phases
when running eagerly, in ``fit(run_eagerly=True)`` and in a custom eager loop,
and a compiled ``fit`` keeps its step time and says it is not split."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest

from dlprof_agent.probe.recorder import LayerSampling, Recorder
from dlprof_agent.probe.tensorflow_hooks import TensorFlowHooks

HAVE_TF = importlib.util.find_spec("tensorflow") is not None
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not HAVE_TF, reason="tensorflow is not installed")]

if HAVE_TF:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

BATCH = 16
WARMUP = 2
SUM_TOLERANCE = 0.01


@pytest.fixture
def attach() -> Iterator[Any]:
    made: list[TensorFlowHooks] = []

    def make(*, layers: bool = True, split: bool = True) -> Recorder:
        recorder = Recorder(warmup_steps=WARMUP,
                            layer_sampling=LayerSampling(every=3) if layers else None)
        recorder.split = split
        hooks = TensorFlowHooks(recorder, layers=layers, split=split)
        hooks.install()
        made.append(hooks)
        return recorder

    yield make
    for hooks in made:  # class-level patches must not outlive a test
        hooks.remove()


def model(*, run_eagerly: bool) -> Any:
    built = keras.Sequential([
        keras.Input((12, 12, 3)),
        keras.layers.Conv2D(8, 3, activation="relu", name="conv"),
        keras.layers.GlobalAveragePooling2D(name="pool"),
        keras.layers.Dense(4, name="head"),
    ])
    built.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  run_eagerly=run_eagerly)
    return built


def data(samples: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(0)
    return (rng.random((samples, 12, 12, 3), dtype=np.float32), rng.integers(0, 4, samples))


def assert_adds_up(snapshot: Any) -> dict[str, float]:
    phases: dict[str, float] = snapshot["phase_seconds"]
    assert snapshot["steps"]["steady"] > 0
    assert min(phases.values()) >= 0
    assert sum(phases.values()) == pytest.approx(snapshot["step_seconds_sum"],
                                                 rel=SUM_TOLERANCE)
    return phases


def test_eager_fit_splits_backward_and_the_optimizer(attach: Any) -> None:
    recorder = attach()
    x, y = data(14 * BATCH)
    model(run_eagerly=True).fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    snapshot = recorder.snapshot()
    phases = assert_adds_up(snapshot)
    assert snapshot["step_source"] == "keras"
    assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0
    assert snapshot["phase_split"] == "split"


def eager_loop(steps: int) -> None:
    """No tf.function: the optimizer's apply ends each step."""
    net = model(run_eagerly=True)
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = data(BATCH)
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, net(x, training=True))
        gradients = tape.gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(gradients, net.trainable_variables, strict=True))


def test_a_custom_eager_loop_has_steps_and_phases(attach: Any) -> None:
    recorder = attach()
    eager_loop(14)
    snapshot = recorder.snapshot()
    phases = assert_adds_up(snapshot)
    assert snapshot["step_source"] == "tf_optimizer"
    assert snapshot["steps"]["steady"] == 14 - 1 - WARMUP  # the first apply starts them
    assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0
    assert snapshot["phase_split"] == "split"


def test_with_the_split_off_an_eager_loop_keeps_its_steps_and_no_phase(attach: Any) -> None:
    recorder = attach(layers=False, split=False)
    eager_loop(14)
    snapshot = recorder.snapshot()
    assert set(assert_adds_up(snapshot)) == {"unsplit"}
    assert snapshot["step_source"] == "tf_optimizer"
    assert snapshot["steps"]["steady"] == 14 - 1 - WARMUP
    assert snapshot["phase_split"] == "not split: turned off"


def test_a_compiled_fit_keeps_its_step_time_and_says_it_is_not_split(attach: Any) -> None:
    recorder = attach()
    x, y = data(14 * BATCH)
    model(run_eagerly=False).fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    snapshot = recorder.snapshot()
    phases = assert_adds_up(snapshot)
    assert snapshot["phase_split"] == "not split: compiled graph"
    assert set(phases) == {"unsplit"}  # not "other": nothing says the time was the input's


def test_eager_fit_without_layer_timing_says_forward_was_not_seen(attach: Any) -> None:
    recorder = attach(layers=False)
    x, y = data(14 * BATCH)
    model(run_eagerly=True).fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    snapshot = recorder.snapshot()
    phases = assert_adds_up(snapshot)
    assert phases["backward"] > 0 and phases["optimizer"] > 0 and "other" not in phases
    assert snapshot["phase_split"] == "forward not seen"


def test_remove_puts_back_the_tape_and_the_optimizer() -> None:
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    gradient, apply = tf.GradientTape.__dict__["gradient"], BaseOptimizer.__dict__["apply"]
    hooks = TensorFlowHooks(Recorder(warmup_steps=WARMUP), layers=True)
    hooks.install()
    x, y = data(4 * BATCH)
    model(run_eagerly=True).fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert tf.GradientTape.__dict__["gradient"] is not gradient
    assert BaseOptimizer.__dict__["apply"] is not apply
    hooks.remove()
    assert tf.GradientTape.__dict__["gradient"] is gradient
    assert BaseOptimizer.__dict__["apply"] is apply
