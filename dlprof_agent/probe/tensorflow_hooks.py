"""TensorFlow and Keras 3 hooks for the in-process probe.

Kept in one file: one class, whose hooks share one lock and the state they
patch in and out; samples and settings are in ``tensorflow_samples`` and
``tensorflow_settings``.

Four hooks, all patched in place and restored by ``remove()``:

- Keras ``model.fit``: each Keras model's ``train_function`` attribute is
  wrapped. The fit loop looks the attribute up on every step, so a wrapper set
  in the middle of a fit takes effect at the next step. Live models are found
  with one ``gc.get_objects()`` scan when Keras hooks are installed; it holds
  the GIL for its duration (tens of milliseconds per million live objects) and
  never runs again. ``TensorFlowTrainer.make_train_function`` is patched so
  that fits starting later are wrapped too. A step ends when the next call
  starts (source ``"keras"``); its samples are the batch size, read from the
  fit loop's data adapter, times the steps one call runs
  (``steps_per_execution``), with the final partial batch of array data
  counted as it is. Each call only stamps its time and the fit's count of steps
  into a ring the recorder replays off the job's path (``tensorflow_steps``),
  where no other framework's hooks own the recorder's ring; the fit's data is
  read at its first step (``tensorflow_samples``).
- Custom loops: ``__call__`` of TensorFlow's ``tf.function`` class is patched.
  The first ``tf.function`` instance called twice from eager code is taken as
  the step function; calls made while tracing and calls nested in a running
  ``tf.function`` are ignored. Another is chosen if that one is garbage
  collected or goes unused for 1000 calls of others. A step ends when the next call starts (source
  ``"tf_function"``); its samples are the leading dimension of the first
  positional argument that has one. Keras's own step function is a
  ``tf.function`` too; the recorder's ranking lets ``"keras"`` win.
- Per-layer forward time (``layers=True``): ``keras.Layer.__call__`` is
  patched and leaf layers are timed, but only while executing eagerly (a model
  compiled with ``run_eagerly=True`` or an eager custom loop). Inside a
  ``tf.function`` the Python call only traces a graph once, so a model compiled
  normally gets no per-layer time; ``settings()["layer_timing"]`` says which
  case applies. The timed steps' leaf layers are also the forward phase, which
  the recorder estimates for the other steps from the timed ones.
- Phases (``split=True``, the default), while executing eagerly (Keras
  ``fit(run_eagerly=True)``, custom eager loops): ``GradientTape.gradient``
  is the backward phase and Keras's ``BaseOptimizer.apply`` (which
  ``apply_gradients`` calls) the optimizer's; with ``split=False`` neither is
  timed, though the optimizer's apply still ends an eager loop's steps.
  One call each per step, whatever the model's size. In an eager loop with
  no ``tf.function`` step, the end of the optimizer's apply ends a step
  (source ``"tf_optimizer"``). Inside a compiled step the Python code runs
  only while tracing: the step is not split (``recorder.COMPILED_GRAPH``).

Limitations: backward time per layer is not available for TensorFlow (the
gradient tape computes the backward pass without calling back into layers). On a GPU an
eager layer call returns once its kernels are queued, so eager per-layer times
there show launch cost, not kernel time. The step that ends an epoch also
spans the epoch's end (validation, epoch callbacks). A ``tf.data`` input whose
batch dimension is unknown (``batch()`` without ``drop_remainder``) gives
steps but no samples. Keras 2 (``tf_keras``) is seen only through the
``tf.function`` fallback.

Nothing here imports TensorFlow or Keras: both are taken from ``sys.modules``,
and their modules, classes, models and tensors are Any here.
Every hook catches its own errors and reports them to the recorder.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from dlprof_agent.probe.patching import Patch
from dlprof_agent.probe.recorder import COMPILED_GRAPH, PRICE_EVERY, Recorder, priced
from dlprof_agent.probe.tensorflow_samples import KerasSamples, leading_dim
from dlprof_agent.probe.tensorflow_settings import (
    KERAS_CONFIG_MODULE,
    layer_timing,
    module_ready,
    read_precision,
    read_settings,
)
from dlprof_agent.probe.tensorflow_steps import (
    KERAS_STEP_EAGER,
    KERAS_STEP_GRAPH,
    TF_FUNCTION_STEP,
    KerasStepEvents,
)
from dlprof_agent.probe.torch_steps import WORDS_PER_EVENT

_FUNCTION_MODULES = (
    ("tensorflow.python.eager.polymorphic_function.polymorphic_function", "Function"),
    ("tensorflow.python.eager.def_function", "Function"),  # TensorFlow < 2.12
)
_CONTEXT_MODULE = "tensorflow.python.eager.context"
_KERAS_TRAINER_MODULE = "keras.src.backend.tensorflow.trainer"
_KERAS_LAYER_MODULE = "keras.src.layers.layer"
_KERAS_TENSOR_MODULE = "keras.src.backend.common.keras_tensor"
_KERAS_STATE_MODULE = "keras.src.backend.common.global_state"
_TAPE_MODULE = "tensorflow.python.eager.backprop"
_KERAS_OPTIMIZER_MODULE = "keras.src.optimizers.base_optimizer"

# On a train_function wrapper: the function it wraps.
_WRAPPED = "__dlprof_wrapped__"
_MAX_CANDIDATES = 64
# Calls of other tf.functions, with none of the step function, before the
# step function is chosen anew (it may have been a one-off helper called twice).
_STALE_CALLS = 1000
# How long install() waits for an import of TensorFlow that is under way.
_IMPORT_WAIT_S = 30.0


class TensorFlowHooks:
    """Step, sample and layer hooks for TensorFlow 2 and Keras 3."""

    name = "tensorflow"

    def __init__(self, recorder: Recorder, *, layers: bool, split: bool = True) -> None:
        self.recorder = recorder
        self.layers = layers
        self.split = split
        # Re-entrant: patched Keras code may run while a hook holds it.
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._removing = False
        self._active = False
        self._patches: list[Patch] = []
        self._local = threading.local()
        self._executing_eagerly: Callable[[], bool] | None = None
        # The tf.function fallback: candidates by id, then the chosen one.
        self._candidates: dict[int, weakref.ref[Any]] = {}
        self._step_function: weakref.ref[Any] | None = None
        self._other_calls = 0
        self._step_optimizer: int | None = None  # the optimizer whose apply ends steps
        # Keras.
        self._keras_pending = False
        self._trainer_class: Any = None
        self._keras_tensor: Any = None
        self._keras_state: Any = None
        self._keras_config: Any = None
        self._wrapped_models: dict[int, tuple[weakref.ref[Any], Any]] = {}
        self._samples = KerasSamples()
        self._events = KerasStepEvents(self._samples)  # the recorder's, unless another's
        self._price_countdown = PRICE_EVERY
        # Facts seen on the training thread, for settings() on the probe thread.
        self._boundaries = 0
        self._layer_calls_in_step = 0
        self._eager_layer_calls = 0
        self._layer_patch: Patch | None = None  # Layer.__call__, on in timed steps only
        self._layer_patched = False  # Layer.__call__ is patched now
        self._layer_step_timed = False  # ... and was during the step that just ended
        self._layer_mode: str | None = None
        self._precision: str | None = None
        self._device: str | None = None

    # Installing and removing: the probe's background thread.

    def install(self) -> None:
        """Patch what is loaded; never imports TensorFlow or Keras."""
        self._removing = False
        try:
            tf = sys.modules.get("tensorflow")
            if tf is None:
                return
            # Attached while the user's thread is still importing TensorFlow:
            # its classes may not exist yet.
            deadline = time.monotonic() + _IMPORT_WAIT_S
            while not module_ready(tf) and time.monotonic() < deadline:
                if self._removing:
                    return
                time.sleep(0.05)
            with self._process_lock():
                if self._active:
                    return
                self._active = True
                if self.recorder.events is None:  # else PyTorch's hooks stamp into it
                    self.recorder.events = self._events
                try:
                    self._install_tf_function()
                except Exception as exc:
                    self.recorder.hook_failed("tensorflow.install", exc)
                self._keras_pending = True
                self._install_keras()
        except Exception as exc:
            self.recorder.hook_failed("keras.install", exc)

    def remove(self) -> None:
        """Put back every attribute patched; safe to call any number of times."""
        self._removing = True
        with self._process_lock():
            self._active = False
            self._keras_pending = False
            if self.recorder.events is self._events:
                self.recorder.drain()
                self.recorder.events = None
                self._events.reset()
            for patch in reversed(self._patches):
                try:
                    patch.undo()
                except Exception as exc:
                    self.recorder.hook_failed("tensorflow.remove", exc)
            self._patches.clear()
            if self._layer_boundary in self.recorder.layer_listeners:
                self.recorder.layer_listeners.remove(self._layer_boundary)
            if self._layer_patch is not None:
                try:
                    self._layer_patch.undo()
                except Exception as exc:
                    self.recorder.hook_failed("tensorflow.remove", exc)
                self._layer_patch = None
            for model_ref, wrapper in list(self._wrapped_models.values()):
                model = model_ref()
                try:
                    if model is not None and model.__dict__.get("train_function") is wrapper:
                        object.__setattr__(model, "train_function", getattr(wrapper, _WRAPPED))
                except Exception as exc:
                    self.recorder.hook_failed("tensorflow.remove", exc)
            self._wrapped_models.clear()
            self._candidates.clear()
            self._step_function = None
            self._samples.forget()

    def _process_lock(self) -> threading.RLock:
        # remove() also runs in forked children (data-loader workers), where
        # a lock another thread held at the fork would never be released.
        if self._pid != os.getpid():
            self._lock = threading.RLock()
            self._pid = os.getpid()
        return self._lock

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        patch = Patch(owner, name, replacement)
        patch.apply()
        self._patches.append(patch)

    def _install_tf_function(self) -> None:
        context = sys.modules.get(_CONTEXT_MODULE)
        function_class = None
        for module_name, class_name in _FUNCTION_MODULES:
            function_class = getattr(sys.modules.get(module_name), class_name, None)
            if function_class is not None:
                break
        if context is None or function_class is None:
            raise RuntimeError("tf.function's class is not loaded")
        self._executing_eagerly = context.executing_eagerly
        self._patch(function_class, "__call__",
                    self._function_call_wrapper(function_class.__call__))
        tape = getattr(sys.modules.get(_TAPE_MODULE), "GradientTape", None)
        if tape is not None and self.split:
            self._patch(tape, "gradient", self._phase_wrapper(tape.gradient, "backward"))

    def _install_keras(self) -> None:
        """Under the lock. Keras may be imported after TensorFlow, so this is
        retried from the tf.function hook until Keras's TensorFlow trainer exists."""
        if not self._keras_pending:
            return
        trainer: Any = sys.modules.get(_KERAS_TRAINER_MODULE)
        layer_module: Any = sys.modules.get(_KERAS_LAYER_MODULE)
        if not (module_ready(trainer) and module_ready(layer_module)):
            return
        self._keras_pending = False
        trainer_class = trainer.TensorFlowTrainer
        self._trainer_class = trainer_class
        self._keras_tensor = getattr(sys.modules.get(_KERAS_TENSOR_MODULE), "KerasTensor", None)
        self._keras_state = sys.modules.get(_KERAS_STATE_MODULE)
        self._keras_config = sys.modules.get(KERAS_CONFIG_MODULE)
        self._patch(trainer_class, "make_train_function",
                    self._make_train_function_wrapper(trainer_class.make_train_function))
        optimizer = getattr(sys.modules.get(_KERAS_OPTIMIZER_MODULE), "BaseOptimizer", None)
        if optimizer is not None:  # also ends an eager loop's steps, split or not
            self._patch(optimizer, "apply", self._phase_wrapper(optimizer.apply, "optimizer"))
        if self.layers:
            # Patched only for timed steps (``_layer_boundary``): the others call Keras as is.
            layer_class = layer_module.Layer
            self._layer_patch = Patch(layer_class, "__call__",
                                       self._layer_call_wrapper(layer_class.__call__))
            self.recorder.layer_listeners.append(self._layer_boundary)
            self._layer_boundary(self.recorder.layer_step)
        for model in self._live_models(trainer_class):
            self._wrap_model(model)

    @staticmethod
    def _live_models(trainer_class: type) -> list[Any]:
        # One scan over the heap, for fits already running. The type check
        # reads only MROs: isinstance could run a proxy's __class__ property.
        verdicts: dict[type, bool] = {}
        found = []
        for obj in gc.get_objects():
            kind = type(obj)
            verdict = verdicts.get(kind)
            if verdict is None:
                verdict = verdicts[kind] = trainer_class in kind.__mro__
            if verdict:
                found.append(obj)
        return found

    def _wrap_model(self, model: Any) -> None:
        """Under the lock: wrap the model's train_function if it has one."""
        current = model.__dict__.get("train_function")
        ours = self._wrapped_models.get(id(model))
        if current is None or (ours is not None and ours[1] is current):
            return
        wrapper = self._train_function_wrapper(weakref.ref(model), current)
        # Keras's __setattr__ tracks state; a plain function needs none of it.
        object.__setattr__(model, "train_function", wrapper)
        self._wrapped_models[id(model)] = (weakref.ref(model), wrapper)

    # Wrappers. Their bodies run on the training thread.

    def _function_call_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        hooks = self

        recorder = self.recorder

        @functools.wraps(original)
        def __call__(function: Any, *args: Any, **kwargs: Any) -> Any:
            # Under Keras's fit its train function marks the steps: a call saved.
            if recorder.step_source == "keras" or not hooks._function_call_start(function,
                                                                                 args):
                return original(function, *args, **kwargs)
            try:
                return original(function, *args, **kwargs)
            finally:
                hooks._local.inside = False

        return __call__

    def _make_train_function_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        hooks = self

        @functools.wraps(original)
        def make_train_function(model: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(model, *args, **kwargs)
            if hooks._active:
                try:
                    with hooks._process_lock():
                        if hooks._active:
                            hooks._wrap_model(model)
                except Exception as exc:
                    hooks.recorder.hook_failed("keras.make_train_function", exc)
            return result

        return make_train_function

    def _train_function_wrapper(self, model_ref: weakref.ref[Any],
                                original: Callable[..., Any]) -> Callable[..., Any]:
        hooks = self

        @functools.wraps(original)
        def train_function(*args: Any, **kwargs: Any) -> Any:
            if hooks._active:
                hooks._keras_call_start(model_ref)
            return original(*args, **kwargs)

        setattr(train_function, _WRAPPED, original)
        return train_function

    def _phase_wrapper(self, original: Callable[..., Any], phase: str) -> Callable[..., Any]:
        hooks = self

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = hooks._phase_start()
            if started is None:
                return original(*args, **kwargs)
            try:
                return original(*args, **kwargs)
            finally:
                hooks._phase_end(phase, started, args)

        return timed

    def _layer_call_wrapper(self, original: Callable[..., Any]) -> Callable[..., Any]:
        hooks = self

        @functools.wraps(original)
        def __call__(layer: Any, *args: Any, **kwargs: Any) -> Any:
            start = hooks._layer_call_start(layer, args)
            if start is None:
                return original(layer, *args, **kwargs)
            result = original(layer, *args, **kwargs)
            hooks._layer_call_end(layer, start)
            return result

        return __call__

    # Hook bodies: never raise.

    @priced
    def _function_call_start(self, function: Any, args: tuple[Any, ...]) -> bool:
        """True when this is a top-level eager call, which the caller must
        close by clearing ``inside``."""
        try:
            if self.recorder.step_source == "keras":
                return False  # Keras's fit marks the steps, and outranks any tf.function
            local = self._local
            if not self._active or getattr(local, "inside", False):
                return False
            eager = self._executing_eagerly
            if eager is None or not eager():  # being traced into another graph
                return False
            if self._keras_pending and self._lock.acquire(blocking=False):
                try:
                    self._install_keras()
                finally:
                    self._lock.release()
            if function is self._choose_step_function(function):
                self._function_boundary(args)
            local.inside = True
            return True
        except Exception as exc:
            self.recorder.hook_failed("tensorflow.function_call", exc)
            return False

    def _function_boundary(self, args: tuple[Any, ...]) -> None:
        """The step function's call: a boundary stamped into the ring where this hook
        owns the recorder's, its bookkeeping then off the job's path; told to the
        recorder at once where the ring is another framework's."""
        recorder = self.recorder
        events = self._events
        now = recorder.clock()
        if recorder.events is not events:
            recorder.step_boundary("tf_function", now)
            if recorder.step_source == "tf_function":
                recorder.unsplit_reason = COMPILED_GRAPH
                self._note_boundary(None)
                samples = leading_dim(args)
                if samples:
                    recorder.add_samples(samples)
            return
        if recorder.step_source in ("", "tf_function"):  # else a stronger source's steps
            self._note_boundary(None)
        events.stamp(TF_FUNCTION_STEP, now, -(leading_dim(args) or 0))
        if recorder.layer_listeners or recorder.capture is not None:
            recorder.layer_boundary()  # layer patches go in or out at boundaries

    def _choose_step_function(self, function: Any) -> Any:
        chosen_ref = self._step_function
        chosen = chosen_ref() if chosen_ref is not None else None
        if chosen is not None:
            if function is chosen:
                self._other_calls = 0
                return chosen
            self._other_calls += 1
            if self._other_calls < _STALE_CALLS:
                return chosen
        self._step_function = None
        self._other_calls = 0
        key = id(function)
        seen = self._candidates.get(key)
        if seen is not None and seen() is function:  # its second call
            self._candidates.clear()
            self._step_function = seen
            return function
        if len(self._candidates) >= _MAX_CANDIDATES:
            self._candidates.clear()
        self._candidates[key] = weakref.ref(function)
        return None

    def _keras_call_start(self, model_ref: weakref.ref[Any]) -> None:
        """A Keras train function's call: a step boundary, stamped into the ring where
        this hook owns the recorder's (no other framework's hooks stamp into it).
        Priced one call in PRICE_EVERY, times PRICE_EVERY."""
        recorder = self.recorder
        now = recorder.clock()
        try:
            events = self._events
            if recorder.events is not events:
                self._keras_boundary(model_ref, now)
                return
            model = model_ref()
            if recorder.step_source != "manual":
                self._note_boundary(model)
            count = self._step_count(sys._getframe(2))  # the wrapper's caller: fit
            written = events.written
            at = (written & events.mask) * WORDS_PER_EVENT
            words = events.words
            words[at] = KERAS_STEP_EAGER if getattr(model, "run_eagerly", False) \
                else KERAS_STEP_GRAPH
            words[at + 1] = now
            words[at + 2] = count
            events.written = written + 1
            if recorder.layer_listeners or recorder.capture is not None:
                recorder.layer_boundary()  # layer patches go in or out at boundaries
            countdown = self._price_countdown - 1
            if countdown:
                self._price_countdown = countdown
            else:
                self._price_countdown = PRICE_EVERY
                recorder.hook_seconds += (recorder.clock() - now) * PRICE_EVERY
        except Exception as exc:
            self.recorder.hook_failed("keras.train_function", exc)

    def _step_count(self, caller: Any) -> int:
        """The event's value (``tensorflow_steps``): the fit's count of steps, or the
        step's samples negated; 0 where they cannot be read (the step still counts)."""
        try:
            count = self._samples.count(caller)
            if count is None:
                if caller.f_code.co_name == "fit":  # its first step: its shape, once the
                    self.recorder.drain()  # earlier steps are counted with theirs
                count = -(self._samples.of_caller(caller) or 0)  # train_on_batch: each
            return count
        except Exception as exc:
            self.recorder.hook_failed("keras.train_function", exc)
            return 0

    def _keras_boundary(self, model_ref: weakref.ref[Any], now: float) -> None:
        """The step boundary told to the recorder at once: the ring is another
        framework's (a job that imported PyTorch's hooks' too)."""
        recorder = self.recorder
        try:
            recorder.step_boundary("keras", now)
            if recorder.step_source != "keras":
                return
            model = model_ref()
            recorder.unsplit_reason = ("" if getattr(model, "run_eagerly", False)
                                       else COMPILED_GRAPH)
            self._note_boundary(model)
            # Frames: this one, _keras_call_start, the wrapper, then whoever called
            # train_function.
            samples = self._samples.of_caller(sys._getframe(3))
            if samples:
                recorder.add_samples(samples)
        except Exception as exc:
            recorder.hook_failed("keras.train_function", exc)
        finally:
            recorder.hook_seconds += recorder.clock() - now

    @priced
    def _phase_start(self) -> tuple[float, float] | None:
        """A phase's mark and start, when it runs eagerly; None inside a graph."""
        try:
            eager = self._executing_eagerly
            if not self._active or eager is None or not eager():
                return None
            return self.recorder.phase_mark(), self.recorder.clock()
        except Exception as exc:
            self.recorder.hook_failed("tensorflow.phase", exc)
            return None

    @priced
    def _phase_end(self, phase: str, started: tuple[float, float],
                   args: tuple[Any, ...]) -> None:
        try:
            now = self.recorder.clock()
            mark, start = started
            recorder = self.recorder
            if self.split:
                recorder.add_phase_time(phase, now - start, since=mark)
            if phase != "optimizer" or not args:
                return
            # With several optimizers (a GAN, say) the first one to apply marks the steps.
            if self._step_optimizer is None:
                self._step_optimizer = id(args[0])
            if id(args[0]) == self._step_optimizer:
                recorder.step_boundary("tf_optimizer", now)
                if recorder.step_source == "tf_optimizer":
                    recorder.unsplit_reason = ""
                    self._note_boundary(None)
        except Exception as exc:
            self.recorder.hook_failed("tensorflow.phase", exc)

    def _layer_call_start(self, layer: Any, args: tuple[Any, ...]) -> float | None:
        try:
            if not self._active or getattr(layer, "_layers", None):
                return None
            eager = self._executing_eagerly
            if eager is None or not eager():
                return None
            # Building a functional model calls layers on symbolic tensors.
            if args and self._keras_tensor is not None and isinstance(args[0], self._keras_tensor):
                return None
            return time.perf_counter()
        except Exception as exc:
            self.recorder.hook_failed("keras.layer_call", exc)
            return None

    def _layer_boundary(self, timed: bool) -> None:
        """At a step boundary, on the training thread: Keras layers patched for a
        timed step, put back for the others."""
        try:
            patch = self._layer_patch
            if patch is None or timed == self._layer_patched:
                return
            with self._process_lock():
                if not self._active:
                    return
                if timed:
                    patch.apply()
                else:
                    patch.undo()
                self._layer_patched = timed
        except Exception as exc:
            self.recorder.hook_failed("keras.layer_sampling", exc)

    def _layer_call_end(self, layer: Any, start: float) -> None:
        try:
            elapsed = time.perf_counter() - start
            self.recorder.add_layer_time(f"{layer.name} {type(layer).__name__}", "forward",
                                         elapsed)
            self.recorder.add_phase_time("forward", elapsed)  # leaves: never nested
            self._layer_calls_in_step += 1
            self._eager_layer_calls += 1
        except Exception as exc:
            self.recorder.hook_failed("keras.layer_call", exc)

    def _note_boundary(self, model: Any) -> None:
        """A step of ours ended: note whether it ran its layers eagerly."""
        self._boundaries += 1
        if self._boundaries > 1 and self._layer_step_timed:
            self._layer_mode = "eager" if self._layer_calls_in_step else "graph"
        self._layer_step_timed = self._layer_patched
        self._layer_calls_in_step = 0
        if self._precision is None or self._boundaries % 256 == 0:
            # Keras keeps its dtype policy per thread: read here, not in settings().
            precision = read_precision(model, self._keras_state, self._keras_config)
            if precision is not None:
                self._precision = precision

    # Settings: the probe's background thread.

    def settings(self) -> dict[str, str]:
        """Framework facts, all strings; a fact that cannot be read is left out."""
        return read_settings(self._read_device, self._precision, layer_timing(
            self.layers, self._layer_mode, self._eager_layer_calls))

    def _read_device(self, tf: Any) -> str:
        # Lists physical devices only, which leaves the user free to configure
        # them; logical devices would initialize the runtime.
        if self._device is None:
            self._device = "gpu" if tf.config.list_physical_devices("GPU") else "cpu"
        return self._device
