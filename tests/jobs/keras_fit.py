"""Keras 3 ``fit`` on numpy arrays held in memory, compiled (the default) or
eager (``--eager``: ``run_eagerly=True``), with a callback that logs each
step's end (step_log.py)."""

from __future__ import annotations

import os
import sys
from typing import Any

from tests.jobs.step_log import StepLog, arguments, enable_probe


def main() -> int:
    parser = arguments(__doc__ or "")
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    enable_probe()
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="conv1"),
        keras.layers.MaxPooling2D(name="pool1"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2"),
        keras.layers.GlobalAveragePooling2D(name="pool2"),
        keras.layers.Dense(10, name="classifier"),
    ], name="small_cnn")
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  run_eagerly=args.eager)
    log = StepLog(args, "keras_eager" if args.eager else "keras_compiled")

    class StepEnds(keras.callbacks.Callback):  # type: ignore[misc,unused-ignore]
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if log.step_ended():
                self.model.stop_training = True

    images = np.random.default_rng(0).standard_normal((2048, 32, 32, 3), dtype=np.float32)
    labels = np.random.default_rng(1).integers(0, 10, 2048)
    model.fit(images, labels, batch_size=args.batch, epochs=1000, verbose=0,
              callbacks=[StepEnds()])
    log.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
