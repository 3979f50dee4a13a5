"""Data-parallel training of a reference Keras model over N processes on this
machine, with tf.distribute's MultiWorkerMirroredStrategy (ring collectives on
CPUs, NCCL on GPUs), timed the way the papers asked their scaling question:
per rank, the compute of each step (forward and backward in one tf.function,
then the optimizer's update) apart from the gradient exchange (an all-reduce
of all gradients, in a tf.function of its own).

The launcher is the process that calls `run_distributed`; it imports no
TensorFlow. The ranks are its children, each one worker of the strategy with
one replica, so an agent attached to the launcher's pid reads every rank, each
under its own pid."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import IO, Any

from dlprof_agent.workloads.distributed import combine_reports
from dlprof_agent.workloads.runner import RunConfig

LEARNING_RATE = 0.01  # as the PyTorch ranks' SGD
TIMEOUT_SECONDS = 600.0
NO_EXCHANGE = "--no-exchange"


def _free_ports(count: int) -> list[int]:
    # Hold every socket until all are bound, so that no two ranks get one port.
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def _last_line(stream: IO[str]) -> str:
    stream.seek(0)
    lines = stream.read().strip().splitlines()
    return lines[-1] if lines else "no output"


def _wait(workers: list[subprocess.Popen[str]], stderr: Sequence[IO[str]],
          timeout: float) -> None:
    """Returns once every rank has exited cleanly; raises as soon as one fails,
    since its peers would otherwise wait on its collectives until the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [worker.poll() for worker in workers]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            raise RuntimeError("; ".join(f"rank {rank}: {_last_line(stderr[rank])}"
                                         for rank in failed))
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            running = [rank for rank, code in enumerate(codes) if code is None]
            raise RuntimeError(f"no result within {timeout:g} s; " + "; ".join(
                f"rank {rank}: {_last_line(stderr[rank])}" for rank in running))
        time.sleep(0.1)


def run_distributed(config: RunConfig, ranks: int, *, exchange: bool = True,
                    timeout: float = TIMEOUT_SECONDS) -> dict[str, Any]:
    """Start ``ranks`` processes, wait for them, and combine what each measured.
    ``exchange=False`` leaves out the all-reduce, so that every rank trains on
    its own data alone: what the exchange is for shows in the weights."""
    addresses = [f"127.0.0.1:{port}" for port in _free_ports(ranks)]
    command = [sys.executable, "-m", "dlprof_agent.workloads.tf_distributed",
               json.dumps(asdict(config)), *([] if exchange else [NO_EXCHANGE])]
    with contextlib.ExitStack() as stack:
        stdout = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(ranks)]
        stderr = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(ranks)]
        workers: list[subprocess.Popen[str]] = []
        try:
            for rank in range(ranks):
                tf_config = {"cluster": {"worker": addresses},
                             "task": {"type": "worker", "index": rank}}
                workers.append(subprocess.Popen(
                    command, stdout=stdout[rank], stderr=stderr[rank], text=True,
                    env={**os.environ, "TF_CONFIG": json.dumps(tf_config),
                         "TF_CPP_MIN_LOG_LEVEL": "2"}))
            _wait(workers, stderr, timeout)
        finally:
            for worker in workers:  # the peers of a failed rank, or every rank on timeout
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
        reports = [json.loads(_last_line(stream)) for stream in stdout]
    return combine_reports(config, reports, extra_per_rank=("weights_checksum",))


def _rank_main(config: RunConfig, exchange: bool) -> int:
    import keras
    import tensorflow as tf

    from dlprof_agent.workloads import keras_models

    rank = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    cuda = config.device == "cuda"
    # Thread settings only take effect before TensorFlow's runtime starts,
    # which the strategy does.
    if config.intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(config.intra_op_threads)
    if config.inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(config.inter_op_threads)
    gpus = tf.config.list_physical_devices("GPU")
    if cuda and not gpus:
        raise RuntimeError("--device cuda, but TensorFlow sees no GPU")
    # One replica per rank: the rank's own GPU (shared if there are fewer GPUs
    # than ranks, hence memory growth), or none at all on the CPU.
    visible = [gpus[rank % len(gpus)]] if cuda else []
    tf.config.set_visible_devices(visible, "GPU")
    for gpu in visible:
        tf.config.experimental.set_memory_growth(gpu, True)
    implementation = (tf.distribute.experimental.CommunicationImplementation.NCCL if cuda
                      else tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=implementation))
    batch = config.resolved_batch()
    with strategy.scope():  # mirrored variables: every rank starts from rank 0's weights
        model = keras_models.build(config.model)
        optimizer = keras.optimizers.SGD(LEARNING_RATE)
        optimizer.build(model.trainable_variables)
    variables = model.trainable_variables
    loss_fn = keras_models.loss(config.model)
    inputs, targets = keras_models.example_batch(config.model, batch, seed=rank)
    images, labels = tf.constant(inputs), tf.constant(targets)

    def finished(tensors: list[Any]) -> Any:
        # One scalar that needs every tensor: fetching it waits for all of them,
        # GPU kernels included.
        return tf.add_n([tf.reshape(tensor, [-1])[0] for tensor in tensors])

    @tf.function  # type: ignore[untyped-decorator]
    def forward_backward(images: Any, labels: Any) -> tuple[list[Any], Any]:
        def replica(images: Any, labels: Any) -> list[Any]:
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(images, training=True))
            # Dense, as PyTorch's: the LSTM's embedding gradient comes as IndexedSlices.
            return [tf.convert_to_tensor(gradient)
                    for gradient in tape.gradient(loss, variables)]

        gradients = strategy.run(replica, args=(images, labels))
        return gradients, finished(gradients)

    @tf.function  # type: ignore[untyped-decorator]
    def all_reduce(gradients: list[Any]) -> tuple[list[Any], Any]:
        def replica(gradients: list[Any]) -> list[Any]:
            # A function's inputs have no device, and all_reduce sends each
            # result to its input's device: identity places them on the replica's.
            placed = [tf.identity(gradient) for gradient in gradients]
            return list(tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.MEAN, placed))

        averaged = strategy.run(replica, args=(gradients,))
        return averaged, finished(averaged)

    @tf.function  # type: ignore[untyped-decorator]
    def update(gradients: list[Any]) -> Any:
        optimizer.apply_gradients(zip(gradients, variables, strict=True))
        return finished(variables)

    compute, exchanged, steps = [], [], []
    for index in range(config.warmup + config.iterations):
        started = time.perf_counter()
        gradients, done = forward_backward(images, labels)
        done.numpy()
        backward_done = time.perf_counter()
        if exchange:
            gradients, done = all_reduce(gradients)
            done.numpy()
        exchange_done = time.perf_counter()
        # Outside the strategy's scope, where Keras's optimizer sums the
        # gradients over the default strategy's one replica, a no-op: inside a
        # replica it would all-reduce them a second time.
        update(gradients).numpy()
        updated = time.perf_counter()
        if index >= config.warmup:
            compute.append((backward_done - started) + (updated - exchange_done))
            exchanged.append(exchange_done - backward_done)
            steps.append(updated - started)
    weights = hashlib.sha256(b"".join(variable.numpy().tobytes() for variable in variables))
    report = {"rank": rank, "pid": os.getpid(), "batch_size": batch,
              "parameters": keras_models.trainable_parameters(model),
              "gradient_bytes": sum(variable.numpy().nbytes for variable in variables),
              "compute_seconds": compute, "exchange_seconds": exchanged, "step_seconds": steps,
              "weights_checksum": weights.hexdigest()[:16]}
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(RunConfig(**json.loads(sys.argv[1])), NO_EXCHANGE not in sys.argv[2:]))
