"""The training job the overhead and scrape benchmarks measure: a reference model
trained on synthetic data in blocks of steps, on command, so that the
configurations being compared take turns inside one process (and the process's
own drift, allocator and caches hit them all alike).

    python -m benchmarks.training_job --framework pytorch --model small-cnn

It enables the in-process probe (dormant until an agent connects), warms up,
and prints ``ready SECONDS`` (a step's median time). Then, per line on stdin,
``SETTLE STEPS MODE`` runs SETTLE untimed steps and STEPS timed ones, and prints
``{"seconds": [each timed step], "cpu": the process's CPU seconds over them,
"busy": the planted busy-wait's seconds}``.
MODE: ``plain``; ``profiler``, the framework's own profiler around the block;
``planted=F``, each step followed by a busy-wait of F times the ready median (a
known slowdown, for the method's own check).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

MODELS = ("small-cnn", "lstm", "resnet-50")  # resnet-50: PyTorch only (gpu-check)
FRAMEWORKS = ("pytorch", "tensorflow")


Step = Callable[[], None]
Profiler = Callable[[], contextlib.AbstractContextManager[Any]]  # the framework's, CPU only


def pytorch_job(args: argparse.Namespace) -> tuple[Step, Profiler]:
    import torch

    from dlprof_agent.workloads import torch_models

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model: torch.nn.Module
    inputs: torch.Tensor
    if args.model == "small-cnn":
        model = torch_models.small_cnn()
        inputs = torch.randn(args.batch, 3, 32, 32)
        labels = torch.randint(0, 10, (args.batch,))
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            torch.nn.CrossEntropyLoss())
    elif args.model == "resnet-50":
        model = torch_models.build("resnet-50")
        inputs, labels = torch_models.example_batch("resnet-50", args.batch)
        loss_fn = torch_models.loss_fn("resnet-50")
    else:
        # The reference LSTM's structure at a size a CPU steps through quickly.
        model = torch_models.LSTMLanguageModel(vocabulary=args.vocabulary, hidden=args.hidden)
        ids = torch.randint(0, args.vocabulary, (args.batch, args.sequence + 1))
        inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        cross_entropy = torch.nn.CrossEntropyLoss()

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss: torch.Tensor = cross_entropy(logits.reshape(-1, args.vocabulary),
                                               targets.reshape(-1))
            return loss
    device = torch.device(args.device)
    model, inputs, labels = model.to(device), inputs.to(device), labels.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def step() -> None:
        optimizer.zero_grad()
        torch.autograd.backward(loss_fn(model(inputs), labels))
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()  # a step's time is its GPU work's too

    def profiler() -> contextlib.AbstractContextManager[Any]:
        return torch.profiler.profile(activities=activities)

    return step, profiler


def tensorflow_job(args: argparse.Namespace) -> tuple[Step, Profiler]:
    import numpy as np
    import tensorflow as tf

    from dlprof_agent.workloads import keras_models

    # Thread settings only take effect before TensorFlow's runtime starts.
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if args.model == "small-cnn":
        model = keras_models.build("small-cnn")
        inputs, labels = keras_models.example_batch("small-cnn", args.batch)
    else:
        keras = tf.keras
        tokens = keras.Input((args.sequence,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(args.vocabulary, args.hidden, name="embedding")(tokens)
        x = keras.layers.LSTM(args.hidden, return_sequences=True, name="lstm1")(x)
        x = keras.layers.LSTM(args.hidden, return_sequences=True, name="lstm2")(x)
        logits = keras.layers.Dense(args.vocabulary, name="logits")(x)
        model = keras.Model(tokens, logits, name="lstm")
        inputs = rng.integers(0, args.vocabulary, (args.batch, args.sequence), dtype=np.int32)
        labels = rng.integers(0, args.vocabulary, (args.batch, args.sequence), dtype=np.int32)
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def step() -> None:
        model.train_on_batch(inputs, labels)  # returns the loss: the step is done

    @contextlib.contextmanager
    def profiler() -> Iterator[None]:
        with tempfile.TemporaryDirectory(prefix="tf-profile-") as logdir:
            tf.profiler.experimental.start(logdir)
            try:
                yield
            finally:
                tf.profiler.experimental.stop()

    return step, profiler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.training_job",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", choices=FRAMEWORKS, default="pytorch")
    parser.add_argument("--model", choices=MODELS, default="small-cnn")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", default="cpu", help="PyTorch only: cpu or cuda")
    parser.add_argument("--vocabulary", type=int, default=2000, help="LSTM only")
    parser.add_argument("--hidden", type=int, default=128, help="LSTM only")
    parser.add_argument("--sequence", type=int, default=20, help="LSTM only: tokens per sample")
    parser.add_argument("--warmup-seconds", type=float, default=2.0)
    args = parser.parse_args(argv)

    import dlprof_agent.probe

    dlprof_agent.probe.enable()  # dormant: one thread asleep until an agent connects
    build = pytorch_job if args.framework == "pytorch" else tensorflow_job
    step, profiler = build(args)
    durations: list[float] = []
    deadline = time.monotonic() + args.warmup_seconds
    while len(durations) < 20 or time.monotonic() < deadline:
        started = time.perf_counter()
        step()
        durations.append(time.perf_counter() - started)

    ready = statistics.median(durations[len(durations) // 2:])
    print(f"ready {ready}", flush=True)

    for line in sys.stdin:
        settle_text, steps_text, mode = line.split()
        planted = ready * float(mode.partition("=")[2]) if mode.startswith("planted=") else 0.0
        block: list[float] = []
        busy = 0.0  # the plant, by the job's own clock: the method's ground truth
        with profiler() if mode == "profiler" else contextlib.nullcontext():
            for _ in range(int(settle_text)):
                step()
            cpu_started = time.process_time()
            for _ in range(int(steps_text)):
                started = time.perf_counter()
                step()
                if planted:
                    waited_from = time.perf_counter()
                    while (now := time.perf_counter()) < waited_from + planted:
                        pass
                    busy += now - waited_from
                block.append(time.perf_counter() - started)
            cpu = time.process_time() - cpu_started
        print(json.dumps({"seconds": block, "cpu": cpu, "busy": busy}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
