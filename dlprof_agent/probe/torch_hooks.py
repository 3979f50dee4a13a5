"""PyTorch hooks: step boundaries, samples per step and per-layer time.

Steps come from the global optimizer hooks; loops without ``torch.optim``
fall back to the start of each training-mode forward of the model. The model
is found by watching module calls for one iteration: the outermost module with
parameters. In a job that has ``torch.compile(module)`` wrappers, only those are
watched, each with a hook of its own: while any global module hook is in, every
call of such a wrapper warns on the job's stderr. A wrapper made after the hooks
went in (``run`` loads them first) meets the global hook: while it is in, torch's
check for global hooks leaves it out (``global_hook_check_without``). A function
compiled after them is looked for once, on the first step that shows no model.
After that only hooks on the model remain, so a step costs a handful of Python calls.

Layer timing is duty-cycled (``recorder.LayerSampling``): hooks go on the leaf
modules at the step boundary before a timed step and come off at the next
one. A module with any hook runs ``Module._call_impl``'s slow path and every
hooked output's autograd node calls back into Python, so hooks left on would
cost every step. Leaves past the ``max_layers`` cap are never hooked. A layer
is named by its path in the model and its type (``features.0 Conv2d``).

Backward time per layer runs from the moment autograd reaches the node that
produced the layer's output to the moment it reaches the next layer's, or the
end of the backward pass: the layer's own gradients plus the glue between it and
the next layer. The hook goes in during forward as ``Tensor.register_hook`` puts
one in, a hook dict on the output attached to its node, but without the
``RemovableHandle`` that ``register_hook`` and ``Node.register_prehook`` build:
that handle cost 3-4x the rest of a layer's backward hook here. An output that
already has hooks, or is not a plain tensor, gets a node pre-hook instead. No
tensor is wrapped, so in-place operations behave as without the probe.
On a GPU these are host-side times (launch and synchronisation); kernel time
is the CUPTI tracer's job. While it traces, each layer's forward and backward
push an external correlation id (``probe.kernel_tracer``), so CUPTI ties every
kernel launched meanwhile to the layer and phase. CUPTI keeps those ids per
thread, and autograd runs backward on its own threads: a backward id is popped
on the thread that pushed it, the next time a hook runs there.

Phases (``split=True``, the default): a step meets four hooks, the model's
forward pre and post hooks and the optimizer's step pre and post hooks, and each
only stamps an event into a ring that the recorder replays later
(``torch_steps``). Forward runs from the model's pre-hook to its forward hook;
backward, derived, from there to the optimizer's step (the loss included); the
optimizer's step is timed less what ran inside it: an optimizer called with a
closure (Lightning's automatic optimization) runs forward and backward inside its
``step``, and the closure is wrapped so that its own time, ``zero_grad`` and what
precedes the forward, is ``other`` and backward ends with it. Where no optimizer
step ends backward (a loop without ``torch.optim``, several forwards a step) or DDP
must be told apart, the output's autograd node gets a pre-hook each step and an
end-of-backward callback marks backward's end. ``split=False``: no phase hook,
closure wrapper or collective timing, and the split says it was turned off.
Waiting for other ranks (DDP, torch.distributed) is ``exchange``: ``torch_exchange``.

Samples per step are the first dimension of the model's first tensor input,
positional or keyword (Hugging Face's ``model(**batch)``), or of the first
tensor in a dict of them (a ``BatchEncoding``).

The probe reports its own cost: the four stamping hooks time themselves on one
step in ``PRICE_EVERY`` (from the stamp to their return, times ``PRICE_EVERY``),
the rarer hooks every call (``priced``). Neither sees torch's dispatch into a hook.
The layer hooks are not priced; what a timed step adds is measured whole
(LayerSampling).

Modules, tensors, autograd nodes and hook handles are torch's objects (Any).

Kept in one file: discovery, step, phase and layer hooks share one step's state
(the model found, the marks of the open phases, the timed leaves).
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import types
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from dlprof_agent.probe.patching import Patch
from dlprof_agent.probe.recorder import PRICE_EVERY, Recorder, priced
from dlprof_agent.probe.torch_exchange import CollectiveTiming, DdpWait, holds_ddp
from dlprof_agent.probe.torch_steps import (
    CLOSURE_ENDED,
    CLOSURE_STARTED,
    COMPILED_ENDED,
    COMPILED_STARTED,
    FORWARD_ENDED,
    FORWARD_STARTED,
    OPTIMIZER_ENDED,
    OPTIMIZER_STARTED,
    WORDS_PER_EVENT,
    StepEvents,
)
from dlprof_agent.probe.torch_values import (
    batch_dimension,
    batch_tensor,
    first_tensor,
    output_node,
)

if TYPE_CHECKING:
    from dlprof_agent.probe.activity_binding import LayerCorrelator, LayerIdSource

SETTINGS_EVERY_CALLS = 64  # re-read thread counts and precision this often
# The layer hook's key in an output's hook dict: never one of RemovableHandle's ids
# (ints), so a hook the job adds to that tensor later keeps its own entry.
LAYER_HOOK_KEY = "dlprof-agent layer"
COMPILED_LAYERS = ("unavailable: the model runs in a torch.compile'd function (its layers "
                   "are one graph; the step's split times the call)")


def compiled_objects() -> tuple[list[Any], list[Any]]:
    """The job's ``torch.compile(module)`` wrappers (OptimizedModule), and the compile
    contexts of its compiled functions (an OptimizeContext each, whose
    ``enter_exit_hooks`` every call of its wrapper runs on entry, outside the compiled
    frame), found with one scan of the garbage collector's objects; none, without a
    scan, where torch.compile was never used."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    context_type = getattr(eval_frame, "OptimizeContext", None)
    if optimized is None:
        return [], []
    modules: list[Any] = []
    wrappers: list[Any] = []
    function = types.FunctionType
    for found in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which some proxies warn on.
        kind = type(found)
        if kind is function:
            # getattr, not __dict__: a function's empty dict would be made on reading.
            if getattr(found, "_torchdynamo_orig_callable", None) is not None:
                wrappers.append(found)
        elif issubclass(kind, optimized):
            modules.append(found)
    # A compiled module's forward is such a wrapper too: its module's hooks time it.
    of_modules = {id(module.__dict__.get("dynamo_ctx")) for module in modules}
    contexts: dict[int, Any] = {}
    for wrapper in wrappers:
        context = compile_context(wrapper)
        if (context is not None and type(context) is context_type
                and id(context) not in of_modules):
            contexts[id(context)] = context
    return modules, list(contexts.values())


def compile_context(wrapper: Any) -> Any:
    """The context a compiled function's wrapper closes over (``self``), where it keeps
    a list of ``enter_exit_hooks``; None for another torch's wrapper."""
    code, cells = getattr(wrapper, "__code__", None), getattr(wrapper, "__closure__", None)
    if code is None or not cells or "self" not in code.co_freevars:
        return None
    try:
        context = cells[code.co_freevars.index("self")].cell_contents
    except ValueError:  # an empty cell
        return None
    return context if isinstance(getattr(context, "enter_exit_hooks", None), list) else None


def _nothing() -> None:
    """The exit of a compiled call made off the training thread."""


def _not_compiling() -> bool:
    """A torch without ``torch.compiler.is_compiling`` (before 2.3)."""
    return False


class HandleGroup:
    """Hook handles (or Patches, undone) removed as one."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            if isinstance(handle, Patch):
                handle.undo()
            else:
                handle.remove()


def global_hook_check_without(module_module: Any, key: int) -> Patch | None:
    """A Patch of ``torch.nn.modules.module._has_any_global_hook`` that does not count
    the global hook registered under ``key``: torch.compile(module)'s wrapper calls it
    at each call and warns, on the job's stderr, while any global hook is in (that hook
    fires an extra time for the wrapper, which discovery takes in its stride). The
    dicts it reads are the original's own globals; None where it reads none."""
    original = module_module.__dict__.get("_has_any_global_hook")
    namespace = module_module.__dict__
    names = [name for name in getattr(getattr(original, "__code__", None), "co_names", ())
             if name.startswith("_global_") and isinstance(namespace.get(name), dict)]
    if not names:
        return None

    def has_any_global_hook() -> bool:
        for name in names:
            hooks = namespace.get(name)
            if hooks and (len(hooks) > 1 or key not in hooks):
                return True
        return False

    return Patch(module_module, "_has_any_global_hook", has_any_global_hook)


class TorchHooks:
    name = "pytorch"

    def __init__(self, recorder: Recorder, *, layers: bool, split: bool = True) -> None:
        self.recorder = recorder
        self.layers = layers
        self.split = split
        self._clock = recorder.clock  # the recorder's: steps and layers on one clock
        self._handles: list[Any] = []
        self._discovery: Any = None
        self._seen: dict[int, Any] = {}  # id -> module, during discovery only
        # Set by the first optimizer step: from there on, iterations are seen whole.
        self._whole_iteration = False
        self._step_optimizer: int | None = None
        self._train_thread: int | None = None  # where the steps' optimizer steps
        self._compile_contexts: list[Any] = []  # compiled functions' contexts, stamped
        self._scanned_compiled = False  # for contexts made after install, once
        self._compiled_exit = self._compiled_ended  # one bound method for every entry
        self._compiled_calls = 0
        self._compiled_batch = 0  # samples a compiled call's arguments held, re-read rarely
        self._events = StepEvents()
        self._forward_open = False  # a training forward's start was stamped
        self._grad_enabled: Any = None  # torch.is_grad_enabled, bound at install
        self._pricing = False  # this step's stamping hooks time themselves
        self._price_countdown = PRICE_EVERY
        self._backward_started = 0.0  # hooked backward (no optimizer, DDP): its start
        self._backward_mark = 0.0
        # Per layer index, on the training thread: the open forward's start, and the
        # timed step's [forward seconds, calls, backward seconds, calls], handed to the
        # recorder as its boundary closes the step (``_flush_layers``).
        self._layer_starts: list[float | None] = []
        self._layer_stats: list[list[float]] = []
        self._layer_hooks: list[tuple[Any, Any]] = []  # per index: (pre, post) for its leaf
        self._layers_unflushed = False
        self._segment_index = -1  # the layer whose backward is running, or -1
        self._segment_start = 0.0
        self._root_calls = 0
        self._batch_dim = 0  # where the batch is in the model's input (torch_values)
        self._observed: dict[str, str] = {}
        self._blas: str | None = None
        self.model_name = ""
        self._torch: Any = sys.modules["torch"]  # the probe only hooks an imported torch
        # True only while dynamo traces a hook into a graph (a compile after the attach
        # that inlines a global hook): the hook then does nothing, so the graph neither
        # breaks nor falls back to eager, and nothing warns on the job's stderr.
        self._compiling: Any = getattr(getattr(self._torch, "compiler", None),
                                       "is_compiling", _not_compiling)
        self._collectives = CollectiveTiming(recorder)
        self._ddp_wait = DdpWait(recorder, self._torch)
        # Kernel attribution: the kernel tracer (its ``correlator`` may come and go),
        # each hooked layer's index in ``layer_labels``, and what is pushed where.
        self.kernels: LayerIdSource | None = None
        self.layer_labels: list[str] = []
        self._backward_hooks: list[Any] = []  # per layer index: its output's hook
        self._hook_dicts = True  # False once this torch lacks the hook-dict path
        self._leaves: list[Any] = []  # the modules timed in a timed step, capped
        self._layer_handles: list[Any] = []  # present only during a timed step
        # Step boundaries (training thread) and remove() (probe thread) both change them.
        self._layer_lock = threading.Lock()
        self._pushed: dict[int, LayerCorrelator] = {}  # index of a layer in forward ->
        self._backward_pushed: dict[int, LayerCorrelator] = {}  # thread ident ->

    # Lifecycle, from the probe thread.

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self.recorder.drain()  # an earlier session's events first
        self.recorder.events = self._events
        self.recorder.discovery_started()
        self._grad_enabled = self._torch.is_grad_enabled
        # In the order a step meets them, the boundary last: the job runs on while
        # they go in (the scan below can take a step under load), and the first
        # boundary must find discovery, and the optimizer's start, already in.
        compiled, contexts = compiled_objects()
        if compiled:
            # torch.compile(module) warns on the job's stderr at each call while any
            # global module hook is in: discover among the compiled modules instead.
            self._discovery = HandleGroup([module.register_forward_pre_hook(self._discover)
                                           for module in compiled])
        else:
            handle = register_module_forward_pre_hook(self._discover)
            quiet = global_hook_check_without(sys.modules["torch.nn.modules.module"],
                                              handle.id)
            if quiet is not None:  # a module compiled after this would warn at each call
                quiet.apply()
            self._discovery = HandleGroup([handle] if quiet is None else [quiet, handle])
        self._scanned_compiled = bool(compiled or contexts)
        if self.split:  # the optimizer's own time; its end is the step's, split or not
            self._handles.append(register_optimizer_step_pre_hook(self._optimizer_started))
            self._collectives.install(self._torch)
            # A new list, never one changed in place: a call may be iterating the old.
            for context in contexts:
                context.enter_exit_hooks = [*context.enter_exit_hooks, self._compiled_entered]
            self._compile_contexts = contexts
        self._handles.append(register_optimizer_step_post_hook(self._optimizer_ended))

    def remove(self) -> None:
        self._collectives.remove()
        for context in self._compile_contexts:
            context.enter_exit_hooks = [hook for hook in context.enter_exit_hooks
                                        if hook != self._compiled_entered]
        self._compile_contexts = []
        if self._layer_boundary in self.recorder.layer_listeners:
            self.recorder.layer_listeners.remove(self._layer_boundary)
        if self._flush_layers in self.recorder.layer_flushes:
            self.recorder.layer_flushes.remove(self._flush_layers)
        with self._layer_lock:
            handles, self._handles = self._handles + self._layer_handles, []
            self._layer_handles = []
            self._leaves = []
        if self._discovery is not None:
            handles.append(self._discovery)
            self._discovery = None
        for handle in handles:
            handle.remove()
        self._seen.clear()
        self._pushed.clear()
        self._backward_pushed.clear()

    # Hooks, on the training thread. Each catches everything: the job never sees them fail.

    # The four stamping hooks: an event each, written inline into the ring (a call
    # less per hook), then the step's rare work. ``now`` is taken first: the event's
    # time, and where the hook's own price starts.

    def _optimizer_started(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        if self._compiling():
            return None
        now = self._clock()
        try:
            events = self._events
            written = events.written
            at = (written & events.mask) * WORDS_PER_EVENT
            words = events.words
            words[at] = OPTIMIZER_STARTED
            words[at + 1] = now
            events.written = written + 1
            replaced = None
            closure = kwargs.get("closure") if kwargs else None
            if closure is not None:
                replaced = args, {**kwargs, "closure": self._timed_closure(closure)}
            elif len(args) > 1 and callable(args[1]):  # args: the optimizer, the closure
                replaced = (args[0], self._timed_closure(args[1]), *args[2:]), kwargs
            if self._pricing:
                self.recorder.hook_seconds += (self._clock() - now) * PRICE_EVERY
            return replaced
        except Exception as error:
            self.recorder.hook_failed("optimizer_pre", error)
        return None

    def _timed_closure(self, closure: Any) -> Any:
        """The closure, stamped at its start and end: forward and backward inside it
        count as themselves, backward ends with it, and the rest (zero_grad, what
        precedes the forward) is other, none of it the optimizer's."""
        events, clock = self._events, self._clock

        def timed_closure() -> Any:
            events.stamp(CLOSURE_STARTED, clock())
            try:
                return closure()
            finally:
                events.stamp(CLOSURE_ENDED, clock())

        return timed_closure

    def _optimizer_ended(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._compiling():
            return
        now = self._clock()
        try:
            # With several optimizers (a GAN, say) the first one to step marks the steps.
            marks_steps = self._step_optimizer is None or id(optimizer) == self._step_optimizer
            events = self._events
            written = events.written
            at = (written & events.mask) * WORDS_PER_EVENT
            words = events.words
            words[at] = OPTIMIZER_ENDED
            words[at + 1] = now
            words[at + 2] = 1.0 if marks_steps else 0.0
            events.written = written + 1
            if marks_steps:
                if self._step_optimizer is None:
                    self._step_optimizer = id(optimizer)
                    self._train_thread = threading.get_ident()
                if self._discovery is not None:
                    self._discovery_step()
                self._boundary_here()
            if self._pricing:
                self.recorder.hook_seconds += (self._clock() - now) * PRICE_EVERY
        except Exception as error:
            self.recorder.hook_failed("optimizer_post", error)

    def _boundary_here(self) -> None:
        """A step boundary was stamped: where layer hooks go in or out at boundaries
        (``--layers``, a trace window), on the job's thread (``Recorder.layer_boundary``)."""
        recorder = self.recorder
        if recorder.layer_listeners or recorder.capture is not None:
            recorder.layer_boundary()

    def _discovery_step(self) -> None:
        # The probe may have arrived mid-forward, having seen only inner modules:
        # decide on the next step, after a whole iteration.
        if self._whole_iteration and self._seen:
            self._finish_discovery()
        else:
            if self._whole_iteration and self.recorder.discovering:
                # A whole step with no training module: steps are steady, not split
                # (told once: a loop that never calls one keeps looking at each step).
                self.recorder.discovery_ended()
                if not self._scanned_compiled:
                    self._hook_later_compiles()
                if self._compile_contexts:
                    # Its model runs in compiled frames: stop looking, or a compile to
                    # come (a new shape) would trace the global hook into its graph.
                    self._discovery.remove()
                    self._discovery = None
                    return
            self._seen.clear()
            self._whole_iteration = True

    def _hook_later_compiles(self) -> None:
        """A whole step with no training module: its model may run in a function
        compiled after the hooks went in (``run`` loads them before the script's
        code). Scanned for once, on the first such step."""
        self._scanned_compiled = True
        if not self.split or "torch._dynamo.eval_frame" not in sys.modules:
            return  # torch.compile never ran
        _modules, contexts = compiled_objects()
        for context in contexts:
            context.enter_exit_hooks = [*context.enter_exit_hooks, self._compiled_entered]
        self._compile_contexts = contexts

    def _discover(self, module: Any, args: Any) -> None:
        if not self._compiling():
            self._discover_module(module)

    @priced
    def _discover_module(self, module: Any) -> None:
        try:
            if not (module.training and self._torch.is_grad_enabled()):
                return
            if id(module) in self._seen:  # a module called again: one iteration has passed
                self._finish_discovery()
            elif next(module.parameters(), None) is not None:
                self._seen[id(module)] = module
        except Exception as error:
            self.recorder.hook_failed("discover", error)

    def _finish_discovery(self) -> None:
        if self._discovery is None:
            return
        self._discovery.remove()
        self._discovery = None
        seen, self._seen = list(self._seen.values()), {}
        inner = {id(child) for module in seen for child in module.modules() if child is not module}
        roots = [module for module in seen if id(module) not in inner]
        if not roots:
            self.recorder.discovery_ended()
            return
        root = max(roots, key=lambda module: sum(p.numel() for p in module.parameters()))
        self.model_name = type(root).__name__
        first = next(root.parameters(), None)
        if first is not None:
            self._observed["device"] = first.device.type
        self._batch_dim = batch_dimension(root, self._torch.nn.RNNBase)
        self._ddp_wait.ddp = holds_ddp(self._torch, root)
        self._handles.append(root.register_forward_pre_hook(self._forward_started,
                                                            with_kwargs=True))
        if self.split:
            self._handles.append(root.register_forward_hook(self._forward_ended,
                                                            always_call=True))
        self.recorder.discovery_ended()  # before the layers: the step may now be timed
        if self.layers:
            self._hook_layers(root)

    def _hook_layers(self, root: Any) -> None:
        """Name the leaf modules; their hooks go in only for timed steps."""
        for name, module in root.named_modules():
            if next(module.children(), None) is not None:
                continue  # containers: their time is their leaves' time
            if len(self._leaves) >= self.recorder.max_layers:
                break  # past the cap: never hooked, so they cost nothing
            label = f"{name} {type(module).__name__}" if name else type(module).__name__
            index = len(self.layer_labels)
            # Each leaf's hooks know its index: no lookup by module on the hot path.
            self._layer_hooks.append((functools.partial(self._layer_pre, index),
                                      functools.partial(self._layer_post, index)))
            hook = functools.partial(self._backward_reached, index)
            # What torch.utils.hooks.unserializable_hook sets: torch.save of an output
            # would otherwise warn, on the job's stderr, that this hook is not saved.
            hook.__torch_unserializable__ = True  # type: ignore[attr-defined]
            self._backward_hooks.append(hook)
            self._layer_starts.append(None)
            self._layer_stats.append([0.0, 0, 0.0, 0])
            self.layer_labels.append(label)
            self._leaves.append(module)
        self.recorder.layer_flushes.append(self._flush_layers)
        self.recorder.layer_listeners.append(self._layer_boundary)
        self._layer_boundary(self.recorder.layer_step)

    def _layer_boundary(self, timed: bool) -> None:
        """At a step boundary: hooks in for a timed step, out for the others."""
        try:
            if timed == bool(self._layer_handles):
                return
            with self._layer_lock:
                if timed and not self._layer_handles:
                    handles = self._layer_handles
                    self._layers_unflushed = True
                    for module, (pre, post) in zip(self._leaves, self._layer_hooks, strict=False):
                        handles.append(module.register_forward_pre_hook(pre))
                        handles.append(module.register_forward_hook(post, always_call=True))
                elif not timed and self._layer_handles:
                    handles, self._layer_handles = self._layer_handles, []
                    for handle in handles:
                        handle.remove()
                    starts = self._layer_starts
                    starts[:] = [None] * len(starts)
                    for correlator in self._pushed.values():
                        correlator.pop()
                    self._pushed.clear()
        except Exception as error:
            self.recorder.hook_failed("layer_sampling", error)

    def _forward_started(self, module: Any, args: Any, kwargs: Any) -> None:
        now = self._clock()
        try:
            if not (module.training and self._grad_enabled()):
                return
            batch: Any = args[0] if args else None  # model(x): the batch, at once
            dims = batch.dim() if isinstance(batch, self._torch.Tensor) else 0
            if not dims:
                batch = batch_tensor(args, kwargs, self._torch.Tensor)
                dims = batch.dim() if batch is not None else 0
            samples = batch.size(self._batch_dim if dims > self._batch_dim else 0) if dims else 0
            events = self._events
            written = events.written
            at = (written & events.mask) * WORDS_PER_EVENT
            words = events.words
            words[at] = FORWARD_STARTED
            words[at + 1] = now
            words[at + 2] = samples
            events.written = written + 1
            self._forward_open = self.split
            self._segment_index = -1  # a backward pass that failed never closed
            calls = self._root_calls
            self._root_calls = calls + 1
            if calls % SETTINGS_EVERY_CALLS == 0:
                self._observe(batch)
            if self._step_optimizer is None:
                self._boundary_here()  # the forward marks the steps
            countdown = self._price_countdown - 1
            if countdown:
                self._price_countdown, self._pricing = countdown, False
            else:  # this step's stamping hooks time themselves, this one included
                self._price_countdown, self._pricing = PRICE_EVERY, True
                self.recorder.hook_seconds += (self._clock() - now) * PRICE_EVERY
        except Exception as error:
            self.recorder.hook_failed("model_forward", error)

    def _forward_ended(self, module: Any, args: Any, output: Any) -> None:
        """The model's forward ended; where backward's end is not derived, a hook
        where backward will begin."""
        now = self._clock()
        try:
            if not self._forward_open:
                return  # not a training forward (or the probe came in during it)
            self._forward_open = False
            derived = not (self._step_optimizer is None or self._ddp_wait.ddp
                           or self._events.several_forwards)
            events = self._events
            written = events.written
            at = (written & events.mask) * WORDS_PER_EVENT
            words = events.words
            words[at] = FORWARD_ENDED
            words[at + 1] = now
            words[at + 2] = 1.0 if derived else 0.0
            events.written = written + 1
            if not derived:
                node = output_node(output, self._torch.Tensor)
                if node is not None:
                    node.register_prehook(self._backward_started_hook)
            if self._pricing:
                self.recorder.hook_seconds += (self._clock() - now) * PRICE_EVERY
        except Exception as error:
            self.recorder.hook_failed("model_forward", error)

    def _compiled_entered(self) -> Any:
        """A compiled function's call begins (its context's enter hook, run before the
        compiled frame): stamped on the training thread once steps are seen. Returns
        the call's exit hook, which its context runs when the call ends."""
        if threading.get_ident() != self._train_thread:
            return _nothing
        now = self._clock()
        try:
            events = self._events
            written = events.written
            at = (written & events.mask) * WORDS_PER_EVENT
            words = events.words
            calls = self._compiled_calls
            self._compiled_calls = calls + 1
            if calls % SETTINGS_EVERY_CALLS == 0:
                self._compiled_batch = self._read_compiled_batch()
            words[at] = COMPILED_STARTED
            words[at + 1] = now
            words[at + 2] = self._compiled_batch
            events.written = written + 1
            # A compiled train step has no forward hook to count the steps to price.
            countdown = self._price_countdown - 1
            if countdown:
                self._price_countdown, self._pricing = countdown, False
            else:
                self._price_countdown, self._pricing = PRICE_EVERY, True
                self.recorder.hook_seconds += (self._clock() - now) * PRICE_EVERY
        except Exception as error:
            self.recorder.hook_failed("compiled_call", error)
        return self._compiled_exit

    def _read_compiled_batch(self) -> int:
        """The batch in a compiled call's arguments: the first tensor's first dimension,
        read from its wrapper's frame, whose locals cost a microsecond to read (so not
        each call: a smaller last batch of an epoch counts as the full one)."""
        frame: Any = sys._getframe(2)  # the wrapper's, or a comprehension's in it (3.11)
        for _ in range(3):
            if frame is None:
                break
            code = frame.f_code
            if "args" in code.co_varnames and code.co_name in ("compile_wrapper", "_fn"):
                names = frame.f_locals
                tensor = batch_tensor(names.get("args"), names.get("kwargs"),
                                      self._torch.Tensor)
                return int(tensor.size(0)) if tensor is not None else 0
            frame = frame.f_back
        return 0

    def _compiled_ended(self) -> None:
        now = self._clock()
        try:
            events = self._events
            written = events.written
            at = (written & events.mask) * WORDS_PER_EVENT
            words = events.words
            words[at] = COMPILED_ENDED
            words[at + 1] = now
            words[at + 2] = 0.0 if events.several_forwards else 1.0  # backward derived
            events.written = written + 1
            if self._pricing:
                self.recorder.hook_seconds += (self._clock() - now) * PRICE_EVERY
        except Exception as error:
            self.recorder.hook_failed("compiled_call", error)

    @priced
    def _backward_started_hook(self, grad_outputs: Any) -> None:
        try:
            if self._backward_started:
                return  # a second output of this pass (two forwards, one backward)
            self._backward_mark = self.recorder.phase_mark()
            self._backward_started = self._clock()
            self._torch.autograd.Variable._execution_engine.queue_callback(
                self._backward_ended)
        except Exception as error:
            self.recorder.hook_failed("model_backward", error)

    @priced
    def _backward_ended(self) -> None:
        try:
            started, self._backward_started = self._backward_started, 0.0
            if started:
                now = self._clock()
                self.recorder.add_phase_time("backward", now - started,
                                             since=self._backward_mark)
                self._ddp_wait.backward_ended(now)
        except Exception as error:
            self.recorder.hook_failed("model_backward", error)

    # Layer hooks: stamps and sums in per-index lists; the recorder gets them whole.

    def _layer_pre(self, index: int, module: Any, args: Any) -> None:
        self._layer_starts[index] = self._clock()
        kernels = self.kernels
        if kernels is not None and kernels.correlator is not None:
            self._push_forward(index, kernels)

    def _push_forward(self, index: int, kernels: LayerIdSource) -> None:
        try:
            correlator = kernels.correlator
            if correlator is not None:
                correlator.push(correlator.base | index << 1)
                self._pushed[index] = correlator
        except Exception as error:
            self.recorder.hook_failed("layer_forward", error)

    def _layer_post(self, index: int, module: Any, args: Any, output: Any) -> None:
        try:
            now = self._clock()
            if self._pushed:
                correlator = self._pushed.pop(index, None)
                if correlator is not None:
                    correlator.pop()
            starts = self._layer_starts
            started = starts[index]
            if started is None:
                return  # its forward began before the hooks went in
            starts[index] = None
            stats = self._layer_stats[index]
            stats[0] += now - started
            stats[1] += 1
            capture = self.recorder.capture
            if capture is not None:
                capture.layer(self.layer_labels[index], "forward", started, now)
            hook = self._backward_hooks[index]
            if (type(output) is self._torch.Tensor and self._hook_dicts
                    and output._backward_hooks is None):
                node = output.grad_fn
                if node is not None:
                    self._hook_output(output, node, hook)
                return
            node = getattr(output, "grad_fn", None)
            if node is None and isinstance(output, (tuple, list)):
                node = getattr(first_tensor(output, self._torch.Tensor), "grad_fn", None)
            if node is not None:
                node.register_prehook(hook)
        except Exception as error:
            self.recorder.hook_failed("layer_forward", error)

    def _hook_output(self, output: Any, node: Any, hook: Any) -> None:
        """``hook`` runs when autograd reaches ``output``'s gradient: a hook dict
        attached to its node, as the first ``Tensor.register_hook`` attaches one."""
        hooks: OrderedDict[Any, Any] = OrderedDict()  # weakly referable, as handles need
        hooks[LAYER_HOOK_KEY] = hook
        try:
            output._backward_hooks = hooks
            node._register_hook_dict(output)
        except (AttributeError, TypeError):  # a torch without this path: handles instead
            self._hook_dicts = False
            output._backward_hooks = None
            node.register_prehook(hook)

    def _backward_reached(self, index: int, grad_outputs: Any) -> None:
        """Autograd reached layer ``index``'s output: the previous layer's backward ends."""
        try:
            now = self._clock()
            previous = self._segment_index
            if previous < 0:  # this pass's first layer: have its end reported
                self._torch.autograd.Variable._execution_engine.queue_callback(
                    self._backward_done)
            else:
                self._backward_segment(previous, now)
            self._segment_index, self._segment_start = index, now
            kernels = self.kernels
            if kernels is not None and (kernels.correlator is not None or self._backward_pushed):
                self._switch_backward(index)
        except Exception as error:
            self.recorder.hook_failed("layer_backward", error)

    def _backward_segment(self, index: int, now: float) -> None:
        stats = self._layer_stats[index]
        stats[2] += now - self._segment_start
        stats[3] += 1
        capture = self.recorder.capture
        if capture is not None:
            capture.layer(self.layer_labels[index], "backward", self._segment_start, now)

    def _switch_backward(self, index: int | None) -> None:
        """Pop this thread's backward id, and push ``index``'s (None: push nothing)."""
        thread = threading.get_ident()
        pushed = self._backward_pushed.pop(thread, None)
        if pushed is not None:
            pushed.pop()
        correlator = self.kernels.correlator if self.kernels is not None else None
        if index is not None and correlator is not None:
            correlator.push(correlator.base | index << 1 | 1)
            self._backward_pushed[thread] = correlator

    def _backward_done(self) -> None:
        try:
            index, self._segment_index = self._segment_index, -1
            if index >= 0:
                self._backward_segment(index, self._clock())
            if self._backward_pushed:
                self._switch_backward(None)
        except Exception as error:
            self.recorder.hook_failed("layer_backward", error)

    def _flush_layers(self) -> None:
        """The timed step's layer times, to the recorder as a boundary closes the step
        (``Recorder.layer_flushes``); nothing to do on the steps between timed ones."""
        if not self._layers_unflushed:
            return
        self._layers_unflushed = bool(self._layer_handles)
        recorder, labels = self.recorder, self.layer_labels
        for index, stats in enumerate(self._layer_stats):
            if stats[1] or stats[3]:
                recorder.add_layer_stats(labels[index], stats)
                stats[:] = (0.0, 0, 0.0, 0)

    # Framework settings.

    def _observe(self, batch: Any) -> None:
        """Read what is per-thread or only visible to the training thread."""
        torch = self._torch
        observed = self._observed
        # OpenMP thread counts are per thread: only the training thread's are the job's.
        observed["intra_op_threads"] = str(torch.get_num_threads())
        observed["inter_op_threads"] = str(torch.get_num_interop_threads())
        device = observed.get("device", "cpu")
        if torch.is_autocast_enabled(device):
            dtype = str(torch.get_autocast_dtype(device)).removeprefix("torch.")
            observed["precision"] = f"amp_{dtype}"
        else:
            observed["precision"] = str(torch.get_default_dtype()).removeprefix("torch.")
        if batch is not None and batch.dim() == 4:
            channels_last = batch.is_contiguous(memory_format=torch.channels_last)
            observed["data_layout"] = "NHWC" if channels_last and batch.shape[1] > 1 else "NCHW"

    def settings(self) -> dict[str, str]:
        torch = sys.modules["torch"]
        if self._blas is None:
            config = torch.__config__.show()
            found = [part.split("=", 1)[1] for part in config.replace(",", " ").split()
                     if part.startswith("BLAS_INFO=")]
            self._blas = found[0] if found else "unknown"
        settings = {
            "framework": "pytorch",
            "framework_version": str(torch.__version__),
            "blas": self._blas,
            "cudnn_autotune": "on" if torch.backends.cudnn.benchmark else "off",
            "step_source": self.recorder.step_source or "none yet",
        }
        if self.model_name:
            settings["model"] = self.model_name
        for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            settings[variable.lower()] = os.environ.get(variable, "unset")
        settings.update(self._observed)
        if not self.layers:
            settings["layer_timing"] = "off"
        elif self._discovery is None and not self.model_name and self._compile_contexts:
            settings["layer_timing"] = COMPILED_LAYERS  # discovery found no eager model
        else:
            settings["layer_timing"] = "on"
        return settings
