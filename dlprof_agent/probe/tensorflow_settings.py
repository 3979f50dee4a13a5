"""TensorFlow's settings as the probe reports them (``settings()`` of the hooks),
read on the probe's thread from the modules already imported, and the facts
the hooks noted on the training thread. TensorFlow and Keras modules are Any."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

GRAPH_MODE = "unavailable: graph mode (compile with run_eagerly=True for per-layer time)"
_FALSE_VALUES = ("0", "false")
KERAS_CONFIG_MODULE = "keras.src.backend.config"


def _env_flag(name: str) -> bool:
    """TensorFlow's reading of a boolean variable that defaults to true."""
    return os.environ.get(name, "1").strip().lower() not in _FALSE_VALUES


def module_ready(module: ModuleType | None) -> bool:
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def read_precision(model: Any, keras_state: Any, keras_config: Any) -> str | None:
    """The model's dtype policy, else Keras's global one; None when unknown.
    Keras keeps its dtype policy per thread: call this on the training thread."""
    policy = getattr(model, "dtype_policy", None) if model is not None else None
    if policy is None:
        if keras_state is None or keras_config is None:
            return None
        # Not keras.mixed_precision.global_policy(): that one stores a default.
        policy = keras_state.get_global_attribute("dtype_policy")
        if policy is None:
            return str(keras_config.floatx())
    return str(policy.name)


def layer_timing(layers: bool, layer_mode: str | None, eager_layer_calls: int) -> str:
    if not layers:
        return "off"
    if layer_mode == "graph":
        return GRAPH_MODE
    if layer_mode == "eager" or eager_layer_calls:
        return "eager"
    return "pending"


def read_settings(device: Callable[[Any], str], precision: str | None, timing: str
                  ) -> dict[str, str]:
    """Framework facts, all strings; a fact that cannot be read is left out.
    ``device`` reads (and may cache) the device kind from the tensorflow module."""
    found = {"framework": "tensorflow"}
    tf: Any = sys.modules.get("tensorflow")
    if not module_ready(tf):
        return found
    keras: Any = sys.modules.get("keras")

    def put(key: str, read: Callable[[], str | None]) -> None:
        try:
            value = read()
        except Exception:
            return
        if value is not None:
            found[key] = value

    put("framework_version", lambda: str(tf.__version__))
    if keras is not None:
        put("keras_version", lambda: str(keras.__version__))
    put("device", lambda: device(tf))
    put("intra_op_threads",
        lambda: _threads(tf.config.threading.get_intra_op_parallelism_threads()))
    put("inter_op_threads",
        lambda: _threads(tf.config.threading.get_inter_op_parallelism_threads()))
    onednn = (sys.platform.startswith("linux")
              and platform.machine().lower() in ("x86_64", "amd64")
              and _env_flag("TF_ENABLE_ONEDNN_OPTS"))
    found["blas"] = "onednn" if onednn else "eigen"
    found["cudnn_autotune"] = "on" if _env_flag("TF_CUDNN_USE_AUTOTUNE") else "off"
    if precision is not None:
        found["precision"] = precision
    config: Any = sys.modules.get(KERAS_CONFIG_MODULE)
    if config is not None:
        put("data_layout", lambda: "NHWC" if config.image_data_format() == "channels_last"
            else "NCHW")
    found["layer_timing"] = timing
    return found


def _threads(value: Any) -> str:
    count = int(value)
    return str(count) if count > 0 else "default"
