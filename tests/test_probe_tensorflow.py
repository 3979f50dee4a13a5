"""The TensorFlow hooks against real TensorFlow and Keras on the CPU.

Step times are checked against clocks the tests keep themselves. The hooks
mark a step at the start of each call of the step function; the tests' clocks
tick just before those calls, so over the same steps both sums span the same
interval, shifted by the microseconds between a tick and the call.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dlprof_agent.probe.recorder import LayerSampling, Recorder
from dlprof_agent.probe.tensorflow_hooks import TensorFlowHooks
from dlprof_agent.probe.tensorflow_settings import GRAPH_MODE

HAVE_TF = importlib.util.find_spec("tensorflow") is not None
pytestmark = [pytest.mark.skipif(not HAVE_TF, reason="tensorflow is not installed"),
              pytest.mark.slow]  # it imports TensorFlow

if HAVE_TF:  # one import for the module: TensorFlow takes seconds to load
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from tensorflow.python.eager.polymorphic_function.polymorphic_function import Function

REPO = Path(__file__).resolve().parents[1]
BATCH = 16
WARMUP = 2
# The sums of the hooks' and the tests' step times may differ by this fraction.
TOLERANCE = 0.03

MakeHooks = Callable[..., tuple[Recorder, TensorFlowHooks]]


@pytest.fixture
def make_hooks() -> Iterator[MakeHooks]:
    made: list[TensorFlowHooks] = []

    def make(*, layers: bool = False,
             recorder: Recorder | None = None) -> tuple[Recorder, TensorFlowHooks]:
        recorder = recorder or Recorder(warmup_steps=WARMUP)
        hooks = TensorFlowHooks(recorder, layers=layers)
        made.append(hooks)
        return recorder, hooks

    yield make
    for hooks in made:  # class-level patches must not outlive a test
        hooks.remove()


def cnn(*, run_eagerly: bool = False, steps_per_execution: int = 1) -> Any:
    model = keras.Sequential([
        keras.Input((24, 24, 3)),
        keras.layers.Conv2D(16, 3, activation="relu", name="conv"),
        keras.layers.GlobalAveragePooling2D(name="pool"),
        keras.layers.Dense(4, name="head"),
    ])
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  run_eagerly=run_eagerly, steps_per_execution=steps_per_execution)
    return model


def data(samples: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(0)
    return (rng.random((samples, 24, 24, 3), dtype=np.float32),
            rng.integers(0, 4, samples))


class BatchClock(keras.callbacks.Callback if HAVE_TF else object):  # type: ignore[misc]
    """Ticks before each call of the train function; can attach the probe
    from a thread of its own after a given batch, as the agent would."""

    def __init__(self, attach_after: int | None = None,
                 attach: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.ticks: list[float] = []
        self.attach_after = attach_after
        self.attach = attach

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.ticks.append(time.perf_counter())

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if batch == self.attach_after and self.attach is not None:
            thread = threading.Thread(target=self.attach)
            thread.start()
            thread.join()


def assert_same_time(recorder: Recorder, ticks: list[float]) -> float:
    """The recorder's steady steps are the last ones before the final tick.
    Returns the relative difference of the two sums."""
    snap = recorder.snapshot()
    steady = snap["steps"]["steady"]
    assert steady > 0
    theirs = ticks[-1] - ticks[-1 - steady]
    ours = snap["step_seconds_sum"]
    difference = abs(ours - theirs) / theirs
    assert difference < TOLERANCE, (ours, theirs, steady)
    return float(difference)


def test_fit_attached_in_the_middle(make_hooks: MakeHooks) -> None:
    recorder, hooks = make_hooks()
    model = cnn()
    x, y = data(40 * BATCH)
    clock = BatchClock(attach_after=3, attach=hooks.install)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[clock])

    snap = recorder.snapshot()
    assert snap["step_source"] == "keras"
    # Calls 4..39 start steps; the first only opens one, the last closes one.
    assert snap["steps"] == {"warmup": WARMUP, "steady": 40 - 4 - 1 - WARMUP}
    assert snap["samples"]["steady"] == snap["steps"]["steady"] * BATCH
    assert snap["hook_errors"] == 0, snap["hook_error_kinds"]
    assert_same_time(recorder, clock.ticks)
    # The last step alone, too.
    assert snap["last_step_seconds"] == pytest.approx(clock.ticks[-1] - clock.ticks[-2],
                                                      rel=0.1, abs=5e-4)


def test_fit_started_later_with_steps_per_execution(make_hooks: MakeHooks) -> None:
    recorder, hooks = make_hooks()
    hooks.install()
    model = cnn(steps_per_execution=2)
    x, y = data(20 * BATCH + 8)  # 21 batches, the last of 8
    clock = BatchClock()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[clock])

    snap = recorder.snapshot()
    assert snap["step_source"] == "keras"
    # 11 calls per epoch, 22 in all: 21 steps closed.
    assert snap["steps"] == {"warmup": WARMUP, "steady": 21 - WARMUP}
    # Epoch 1 calls 2..10 (the last one 8 samples), epoch 2 calls 0..9.
    assert snap["samples"]["steady"] == 8 * 2 * BATCH + 8 + 10 * 2 * BATCH
    assert snap["hook_errors"] == 0, snap["hook_error_kinds"]
    assert_same_time(recorder, clock.ticks)


def boundaries_told(recorder: Recorder) -> list[tuple[Any, ...]]:
    """The step boundaries told to ``recorder`` directly (by a hook on the job's
    thread), not replayed from the ring; they still reach it."""
    told: list[tuple[Any, ...]] = []
    step_boundary = recorder.step_boundary

    def telling(*args: Any) -> None:
        told.append(args)
        step_boundary(*args)

    recorder.step_boundary = telling  # type: ignore[method-assign,assignment]
    return told


def test_a_keras_step_is_stamped_and_each_fit_counted_with_its_own_batches(
        make_hooks: MakeHooks) -> None:
    """The job's thread only stamps each step: the recorder closes steps when it
    replays them. Two fits of different batches and data, with no snapshot between
    them, are each counted with their own, their last partial batches included."""
    recorder, hooks = make_hooks()
    hooks.install()
    boundaries_on_the_job = boundaries_told(recorder)
    model = cnn()
    x, y = data(10 * BATCH + 4)  # 11 batches, the last of 4
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    x, y = data(6 * 8 + 3)  # 7 batches of 8, the last of 3
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert recorder.events is hooks._events and hooks._events.pending()
    snap = recorder.snapshot()
    # None: Keras's steps and the first call's tf.function (before Keras's first step
    # outranked it) are both stamped.
    assert boundaries_on_the_job == []
    assert snap["step_source"] == "keras" and snap["hook_errors"] == 0
    # 11 + 14 calls; the first call of all only opens a step.
    assert snap["steps"]["warmup"] + snap["steps"]["steady"] == 11 + 14 - 1
    # Every call's samples but the last's, whose step is still open (its partial 3).
    assert snap["samples"]["warmup"] + snap["samples"]["steady"] == \
        (10 * BATCH + 4) + 2 * (6 * 8 + 3) - 3


def test_keras_loaded_after_install(make_hooks: MakeHooks,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Attached between `import tensorflow` and Keras's import: the Keras hooks
    # follow at the first tf.function call, inside the fit already running.
    recorder, hooks = make_hooks()
    make_train_function = TensorFlowTrainer.__dict__["make_train_function"]
    with monkeypatch.context() as patch:
        patch.delitem(sys.modules, "keras.src.backend.tensorflow.trainer")
        hooks.install()
    assert TensorFlowTrainer.__dict__["make_train_function"] is make_train_function
    x, y = data(8 * BATCH)
    cnn().fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    snap = recorder.snapshot()
    assert TensorFlowTrainer.__dict__["make_train_function"] is not make_train_function
    assert snap["step_source"] == "keras"
    # Calls 1..7 are wrapped.
    assert snap["steps"] == {"warmup": WARMUP, "steady": 8 - 1 - 1 - WARMUP}
    assert snap["samples"]["steady"] == snap["steps"]["steady"] * BATCH


def custom_loop(steps: int, ticks: list[float] | None = None) -> Any:
    """A training loop with a tf.function step, another one nested in it and
    a helper called once."""
    model = cnn()
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def compute_loss(x: Any, y: Any) -> Any:
        return loss_fn(y, model(x, training=True))

    nested = tf.function(compute_loss)

    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = nested(x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    train_step = tf.function(step)
    summary = tf.function(tf.reduce_mean)

    x, y = data(2 * BATCH)
    x, y = tf.constant(x), tf.constant(y)
    summary(x)
    loss = None
    for _ in range(steps):
        if ticks is not None:
            ticks.append(time.perf_counter())
        loss = train_step(x, y)
    return loss


def test_custom_loop_with_a_tf_function_step(make_hooks: MakeHooks) -> None:
    """The step function's calls are stamped, as Keras's are: the job's thread never
    closes a step itself."""
    recorder, hooks = make_hooks()
    hooks.install()
    boundaries_on_the_job = boundaries_told(recorder)
    ticks: list[float] = []
    custom_loop(30, ticks)
    assert recorder.events is hooks._events and hooks._events.pending()

    snap = recorder.snapshot()
    assert boundaries_on_the_job == []
    assert snap["step_source"] == "tf_function"
    # The first call only makes it a candidate, the second opens a step.
    assert snap["steps"] == {"warmup": WARMUP, "steady": 30 - 2 - WARMUP}
    assert snap["samples"]["steady"] == snap["steps"]["steady"] * 2 * BATCH
    assert snap["hook_errors"] == 0, snap["hook_error_kinds"]
    assert_same_time(recorder, ticks)


def test_remove_restores_everything(make_hooks: MakeHooks) -> None:
    function_call = Function.__dict__["__call__"]
    layer_call = keras.Layer.__dict__["__call__"]
    make_train_function = TensorFlowTrainer.__dict__["make_train_function"]
    x, y = data(4 * BATCH)
    trained = cnn()
    trained.fit(x, y, batch_size=BATCH, verbose=0)
    train_function = trained.train_function

    recorder, hooks = make_hooks(layers=True)
    hooks.install()
    assert Function.__dict__["__call__"] is not function_call
    # Keras layers are patched only for timed steps: none before the warm-up ends.
    assert keras.Layer.__dict__["__call__"] is layer_call
    assert TensorFlowTrainer.__dict__["make_train_function"] is not make_train_function
    assert trained.train_function is not train_function  # found by the heap scan
    trained.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    assert keras.Layer.__dict__["__call__"] is not layer_call
    later = cnn()
    later.fit(x, y, batch_size=BATCH, verbose=0)
    later_function = later.train_function.__dlprof_wrapped__
    assert recorder.snapshot()["steps"]["steady"] > 0

    hooks.remove()
    hooks.remove()
    assert Function.__dict__["__call__"] is function_call
    assert keras.Layer.__dict__["__call__"] is layer_call
    assert TensorFlowTrainer.__dict__["make_train_function"] is make_train_function
    assert trained.train_function is train_function
    assert later.train_function is later_function

    before = recorder.snapshot()
    history = trained.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    custom_loop(3)
    assert recorder.snapshot() == before


def test_a_failing_hook_is_counted_and_training_goes_on(make_hooks: MakeHooks) -> None:
    recorder, hooks = make_hooks()

    def broken(caller: Any) -> int:
        raise RuntimeError("recorder is broken")

    hooks._samples.count = broken  # type: ignore[method-assign]
    hooks.install()
    x, y = data(6 * BATCH)
    history = cnn().fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert len(history.history["loss"]) == 1
    snap = recorder.snapshot()
    assert snap["hook_errors"] == 6
    assert "recorder is broken" in snap["hook_error_kinds"]["keras.train_function"]
    assert snap["steps"]["warmup"] + snap["steps"]["steady"] == 5
    hooks.remove()

    recorder, hooks = make_hooks()

    def broken_stamp(*args: Any) -> None:
        raise RuntimeError("recorder is broken")

    hooks._events.stamp = broken_stamp  # type: ignore[method-assign,assignment]
    hooks.install()
    loss = custom_loop(5)
    assert np.isfinite(float(loss))
    snap = recorder.snapshot()
    assert snap["hook_errors"] == 4  # every call after the first
    assert "tensorflow.function_call" in snap["hook_error_kinds"]


def test_layer_times_in_eager_mode(make_hooks: MakeHooks) -> None:
    recorder, hooks = make_hooks(layers=True)
    hooks.install()
    x, y = data(6 * BATCH)
    model = cnn(run_eagerly=True)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)

    snap = recorder.snapshot()
    layers = {name: stats for name, *stats in snap["layers"]}
    # Leaves only, not the model; each named with its type.
    assert set(layers) == {"conv Conv2D", "pool GlobalAveragePooling2D", "head Dense"}
    for forward_seconds, forward_calls, backward_seconds, backward_calls in layers.values():
        # The recorder skips the warm-up steps' layers, and counts a step's when
        # it ends: the sixth ends with the next call.
        assert forward_calls == 6 - WARMUP - 1
        assert forward_seconds > 0
        assert (backward_seconds, backward_calls) == (0, 0)
    assert snap["phase_seconds"]["forward"] > 0
    assert hooks.settings()["layer_timing"] == "eager"


def test_keras_layers_are_patched_only_for_timed_steps(make_hooks: MakeHooks) -> None:
    """One step in three timed: Keras's own Layer.__call__ runs the others."""
    layer_call = keras.Layer.__dict__["__call__"]
    recorder, hooks = make_hooks(
        recorder=Recorder(warmup_steps=WARMUP, layer_sampling=LayerSampling(every=3)),
        layers=True)
    hooks.install()
    seen: list[tuple[bool, bool]] = []

    class Watch(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            # Runs after the step, before the next boundary: the step's own state.
            seen.append((recorder.layer_step,
                         keras.Layer.__dict__["__call__"] is not layer_call))

    x, y = data(20 * BATCH)
    cnn(run_eagerly=True).fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[Watch()])
    assert all(timed == patched for timed, patched in seen)
    assert [timed for timed, _ in seen[WARMUP:]] == [False, False, True] * 6
    snap = recorder.snapshot()
    assert snap["layer_sampled_steps"] == 6 - 1  # the last one ends with the next call
    layers = {name: stats for name, *stats in snap["layers"]}
    # Five timed steps standing for three steps each.
    assert {stats[1] for stats in layers.values()} == {15}
    hooks.remove()
    assert keras.Layer.__dict__["__call__"] is layer_call


def test_no_layer_times_in_graph_mode(make_hooks: MakeHooks) -> None:
    recorder, hooks = make_hooks(layers=True)
    hooks.install()
    assert hooks.settings()["layer_timing"] == "pending"
    x, y = data(6 * BATCH)
    cnn().fit(x, y, batch_size=BATCH, epochs=1, verbose=0)

    snap = recorder.snapshot()
    assert snap["steps"]["steady"] > 0
    assert snap["layers"] == []
    assert hooks.settings()["layer_timing"] == GRAPH_MODE


def test_settings(make_hooks: MakeHooks) -> None:
    _, hooks = make_hooks()
    hooks.install()
    custom_loop(3)
    settings = hooks.settings()
    assert all(isinstance(value, str) for value in settings.values())
    assert settings["framework"] == "tensorflow"
    assert settings["framework_version"] == tf.__version__
    assert settings["keras_version"] == keras.__version__
    expected_device = "gpu" if tf.config.list_physical_devices("GPU") else "cpu"
    assert settings["device"] == expected_device
    for key in ("intra_op_threads", "inter_op_threads"):
        assert settings[key] == "default" or int(settings[key]) > 0
    assert settings["blas"] in ("onednn", "eigen")
    assert settings["cudnn_autotune"] in ("on", "off")
    assert settings["precision"] == "float32"
    assert settings["data_layout"] == "NHWC"
    assert settings["layer_timing"] == "off"
    start = time.perf_counter()
    for _ in range(20):
        hooks.settings()
    assert (time.perf_counter() - start) / 20 < 0.01


def test_precision_is_the_training_threads(make_hooks: MakeHooks) -> None:
    # Keras keeps its dtype policy per thread; the agent asks from its own.
    _, hooks = make_hooks()
    hooks.install()
    step = tf.function(lambda x: x * 2)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for _ in range(3):
            step(tf.ones((4, 2)))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    seen: list[dict[str, str]] = []
    thread = threading.Thread(target=lambda: seen.append(hooks.settings()))
    thread.start()
    thread.join()
    assert seen[0]["precision"] == "mixed_float16"


def test_without_tensorflow_loaded_nothing_is_imported() -> None:
    code = (
        "import sys\n"
        "from dlprof_agent.probe.recorder import Recorder\n"
        "from dlprof_agent.probe.tensorflow_hooks import TensorFlowHooks\n"
        "hooks = TensorFlowHooks(Recorder(), layers=True)\n"
        "hooks.install()\n"
        "settings = hooks.settings()\n"
        "hooks.remove()\n"
        "loaded = sorted(m for m in ('tensorflow', 'keras', 'numpy') if m in sys.modules)\n"
        "print(loaded, settings)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] {'framework': 'tensorflow'}"
