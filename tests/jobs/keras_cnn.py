"""A small Keras CNN on synthetic data, for the probe's tests: trained with
model.fit or with a custom loop around a tf.function step, logging each step's
start on the job's own clock."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np
import tensorflow as tf


def small_cnn() -> Any:
    keras = tf.keras
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--loop", choices=("fit", "custom"), default="fit")
    parser.add_argument("--log", required=True)
    parser.add_argument("--linger", type=float, default=0.0)
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.random.set_seed(0)
    model = small_cnn()
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = tf.keras.optimizers.SGD(0.01)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((args.batch, 32, 32, 3), dtype=np.float32)
    labels = rng.integers(0, 10, args.batch)
    log = open(args.log, "w")  # noqa: SIM115 - written by a callback until the end
    log.write(json.dumps({"pid": os.getpid()}) + "\n")

    def mark(step: int) -> None:
        log.write(json.dumps({"step": step, "start": time.perf_counter()}) + "\n")
        log.flush()

    if args.loop == "fit":
        class Timer(tf.keras.callbacks.Callback):  # type: ignore[misc]
            def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
                mark(batch)

        model.compile(optimizer=optimizer, loss=loss_fn)
        data = np.repeat(images, args.steps, axis=0)
        model.fit(data, np.tile(labels, args.steps), batch_size=args.batch, epochs=1,
                  verbose=0, callbacks=[Timer()])
    else:
        @tf.function  # type: ignore[untyped-decorator]
        def train_step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                          model.trainable_variables, strict=True))
            return loss

        x, y = tf.constant(images), tf.constant(labels)
        for step in range(args.steps):
            mark(step)
            train_step(x, y)
    log.write(json.dumps({"done": True}) + "\n")
    log.close()
    time.sleep(args.linger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
