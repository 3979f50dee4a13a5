"""Runs one reference workload in this process and measures it the way the
papers did: time per mini-batch over the steady iterations, samples per second,
and peak memory. Warm-up iterations (default 10, as in Liu et al.) are run but
kept out of the figures."""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dlprof_agent.workloads.models import MODELS

FRAMEWORKS = ("pytorch", "tensorflow")
LAYOUTS = ("NCHW", "NHWC")
PRECISIONS = ("fp32", "amp")
TINY_BATCH = 2  # --scale tiny: enough to run every layer, small enough for any CPU


@dataclass(frozen=True)
class RunConfig:
    framework: str
    model: str
    device: str = "cpu"
    batch_size: int | None = None  # None: the papers' CPU batch (or TINY_BATCH when tiny)
    iterations: int = 50
    warmup: int = 10
    intra_op_threads: int | None = None  # None: the framework's default
    inter_op_threads: int | None = None
    layout: str | None = None  # None: NCHW for PyTorch, NHWC for TensorFlow
    cudnn_autotune: bool = False
    precision: str = "fp32"
    input_grad: bool = False  # compute the first layer's unneeded input gradient (Kim §IV-C)
    scale: str = "full"
    data: str | None = None  # MNIST or CIFAR-10 files instead of synthetic data
    data_delay_seconds: float = 0.0  # each step first waits this long, as on a slow loader
    # Under `workload run --attach`: hold the first step until the agent's probe has
    # hooked the framework, and the exit until the agent has read the last step (each
    # at most this long), so that it counts every step.
    wait_for_probe_seconds: float = 0.0

    def resolved_batch(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return TINY_BATCH if self.scale == "tiny" else MODELS[self.model].cpu_batch

    def resolved_layout(self) -> str:
        return self.layout or ("NCHW" if self.framework == "pytorch" else "NHWC")


@dataclass(frozen=True)
class RunResult:
    config: RunConfig
    batch_size: int
    parameters: int
    step_seconds: list[float] = field(repr=False)  # the steady iterations, in order
    cpu: CpuUse
    peak_rss_bytes: int = 0
    peak_device_memory_bytes: int | None = None

    @property
    def seconds_per_batch(self) -> float:
        return statistics.median(self.step_seconds)

    @property
    def samples_per_second(self) -> float:
        return self.batch_size / self.seconds_per_batch

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self.config), "layout": self.config.resolved_layout(),
                "batch_size": self.batch_size,
                "parameters": self.parameters, "seconds_per_batch": self.seconds_per_batch,
                "mean_seconds_per_batch": statistics.fmean(self.step_seconds),
                "samples_per_second": self.samples_per_second,
                "cpu_user_seconds_per_batch": self.cpu.user_seconds / len(self.step_seconds),
                "cpu_system_seconds_per_batch": (self.cpu.system_seconds
                                                 / len(self.step_seconds)),
                "voluntary_switches_per_batch": (self.cpu.voluntary_switches
                                                 / len(self.step_seconds)),
                "involuntary_switches_per_batch": (self.cpu.involuntary_switches
                                                   / len(self.step_seconds)),
                "peak_rss_bytes": self.peak_rss_bytes,
                "peak_device_memory_bytes": self.peak_device_memory_bytes}


MNIST_MODELS = ("fcn-r",)
CIFAR_MODELS = ("alexnet-r", "resnet-56", "small-cnn")


def real_batches(config: RunConfig, batch: int) -> Any:
    """Mini-batches (channels-last images, labels) from the user's dataset files."""
    from dlprof_agent.workloads import datasets

    path = Path(config.data or "")
    if config.model in MNIST_MODELS:
        def find(stem: str) -> Path:
            for name in (stem, stem + ".gz"):
                if (path / name).exists():
                    return path / name
            raise datasets.DatasetError(f"{path}: no {stem} or {stem}.gz in it")
        inputs, labels = datasets.load_mnist(find("train-images-idx3-ubyte"),
                                             find("train-labels-idx1-ubyte"))
    elif config.model in CIFAR_MODELS:
        inputs, labels = datasets.load_cifar10(str(path))
    else:
        raise ValueError(f"{config.model} trains on synthetic data only; --data fits "
                         f"{', '.join(MNIST_MODELS)} (MNIST) and {', '.join(CIFAR_MODELS)} "
                         "(CIFAR-10)")
    return datasets.Batches(inputs, labels, batch, seed=0)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@dataclass(frozen=True)
class CpuUse:
    """The process's CPU time and context switches over the timed iterations, all
    threads together: the papers' %user and %system, and the sign of oversubscription."""

    user_seconds: float
    system_seconds: float
    voluntary_switches: int
    involuntary_switches: int

    @classmethod
    def between(cls, before: resource.struct_rusage, after: resource.struct_rusage) -> CpuUse:
        return cls(after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
                   after.ru_nvcsw - before.ru_nvcsw, after.ru_nivcsw - before.ru_nivcsw)


def wait_for_probe(seconds: float) -> bool:
    """Whether an agent attached to this process's probe and its hooks are in, within
    ``seconds``. The agent connects once the probe's socket appears and hooks the
    framework on its next sample: steps taken before that are not counted."""
    from dlprof_agent.probe import runtime

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        probe = runtime.current()
        session = probe.session if probe is not None else None
        if session is not None and session.hooks:
            return True
        time.sleep(0.02)
    return False


def wait_for_agent_to_read(seconds: float) -> bool:
    """Whether the attached agent read the probe after the last step, within ``seconds``.
    It samples every interval: a run that ends between two samples would otherwise
    take its last steps with it. Two requests after now: the first one's answer (the
    final counts) was sent before the second came."""
    from dlprof_agent.probe import runtime

    probe = runtime.current()
    session = probe.session if probe is not None else None
    if session is None:
        return False
    requests, last = 0, session.last_message
    deadline = time.monotonic() + seconds
    while requests < 2 and time.monotonic() < deadline:
        if session.last_message != last:
            requests, last = requests + 1, session.last_message
        time.sleep(0.01)
    return requests >= 2


def _timed(step: Callable[[], None], config: RunConfig,
           on_step: Callable[[int, int], None] | None) -> tuple[list[float], CpuUse]:
    total = config.warmup + config.iterations
    durations = []
    if config.wait_for_probe_seconds:
        wait_for_probe(config.wait_for_probe_seconds)
    before = resource.getrusage(resource.RUSAGE_SELF)
    for index in range(total):
        if index == config.warmup:
            before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        if config.data_delay_seconds:
            time.sleep(config.data_delay_seconds)  # the batch is late: part of the step
        step()
        if index >= config.warmup:
            durations.append(time.perf_counter() - started)
        if on_step is not None:
            on_step(index + 1, total)
    cpu = CpuUse.between(before, resource.getrusage(resource.RUSAGE_SELF))
    if config.wait_for_probe_seconds:
        wait_for_agent_to_read(config.wait_for_probe_seconds)
    return durations, cpu


def run_pytorch(config: RunConfig, on_step: Callable[[int, int], None] | None = None
                ) -> RunResult:
    import torch

    from dlprof_agent.workloads import torch_models

    if config.intra_op_threads:
        torch.set_num_threads(config.intra_op_threads)
    if config.inter_op_threads:
        torch.set_num_interop_threads(config.inter_op_threads)
    torch.backends.cudnn.benchmark = config.cudnn_autotune
    device = torch.device(config.device)
    batch = config.resolved_batch()
    generator = torch.Generator().manual_seed(0)
    model = torch_models.build(config.model).to(device)
    inputs, targets = torch_models.example_batch(config.model, batch, generator=generator)
    inputs, targets = inputs.to(device), targets.to(device)
    if config.resolved_layout() == "NHWC" and inputs.dim() == 4:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    if config.input_grad and inputs.is_floating_point():
        inputs.requires_grad_(True)
    loss_fn = torch_models.loss_fn(config.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    amp = config.precision == "amp"
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    channels_last = config.resolved_layout() == "NHWC"
    batches = real_batches(config, batch) if config.data else None

    def step() -> None:
        nonlocal inputs, targets
        if batches is not None:  # the host-to-device copy is part of the step, as in training
            images, labels = next(batches)
            tensor = torch.from_numpy(images)
            if tensor.dim() == 4:
                tensor = tensor.permute(0, 3, 1, 2)  # files are channels-last
                tensor = tensor.contiguous(memory_format=torch.channels_last if channels_last
                                           else torch.contiguous_format)
            inputs, targets = tensor.to(device), torch.from_numpy(labels).to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp):
            loss = loss_fn(model(inputs), targets)
        torch.autograd.backward(loss)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()  # time the work, not its launch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    durations, cpu = _timed(step, config, on_step)
    device_peak = (int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda"
                   else None)
    return RunResult(config, batch, torch_models.trainable_parameters(model), durations, cpu,
                     _peak_rss_bytes(), device_peak)


def run_tensorflow(config: RunConfig, on_step: Callable[[int, int], None] | None = None
                   ) -> RunResult:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["TF_CUDNN_USE_AUTOTUNE"] = "1" if config.cudnn_autotune else "0"
    import tensorflow as tf

    from dlprof_agent.workloads import keras_models

    # Thread settings only take effect before TensorFlow's runtime starts.
    if config.intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(config.intra_op_threads)
    if config.inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(config.inter_op_threads)
    if config.precision == "amp":
        tf.keras.mixed_precision.set_global_policy(
            "mixed_float16" if config.device == "cuda" else "mixed_bfloat16")
    data_format = "channels_first" if config.resolved_layout() == "NCHW" else "channels_last"
    batch = config.resolved_batch()
    device = "/GPU:0" if config.device == "cuda" else "/CPU:0"
    with tf.device(device):
        model = keras_models.build(config.model, data_format=data_format)
        model.compile(optimizer=tf.keras.optimizers.SGD(0.01),
                      loss=keras_models.loss(config.model))
        inputs, targets = keras_models.example_batch(config.model, batch, seed=0,
                                                     data_format=data_format)
        batches = real_batches(config, batch) if config.data else None

        def step() -> None:
            images, labels = (inputs, targets) if batches is None else next(batches)
            if batches is not None and data_format == "channels_first" and images.ndim == 4:
                images = images.transpose(0, 3, 1, 2)
            model.train_on_batch(images, labels)  # returns the loss: the step is done

        durations, cpu = _timed(step, config, on_step)
    device_peak = None
    if config.device == "cuda":
        device_peak = int(tf.config.experimental.get_memory_info("GPU:0")["peak"])
    return RunResult(config, batch, keras_models.trainable_parameters(model), durations, cpu,
                     _peak_rss_bytes(), device_peak)


def run(config: RunConfig, on_step: Callable[[int, int], None] | None = None) -> RunResult:
    if config.model not in MODELS:
        raise ValueError(f"unknown model {config.model!r}; known: {', '.join(MODELS)}")
    if config.framework == "pytorch":
        return run_pytorch(config, on_step)
    if config.framework == "tensorflow":
        return run_tensorflow(config, on_step)
    raise ValueError(f"unknown framework {config.framework!r}; known: {', '.join(FRAMEWORKS)}")
