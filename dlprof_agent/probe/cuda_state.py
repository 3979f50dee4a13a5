"""What the job's process is doing with CUDA, asked without changing it: whether
it has started CUDA, whether a profiler of its own needs CUPTI now, whether a
tool injected itself into CUDA, and its devices' UUIDs. The kernel tracer asks
these on the probe thread; none of them starts CUDA or imports a framework."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping

from dlprof_agent.probe import cupti_versions, profiler_yield
from dlprof_agent.probe.frameworks import framework_imported


def cuda_in_use() -> bool:
    """Whether the job has started CUDA; never starts it itself."""
    if "torch" in sys.modules and framework_imported("torch"):
        with contextlib.suppress(Exception):
            if sys.modules["torch"].cuda.is_initialized():
                return True
    if "torch" not in sys.modules or "tensorflow" in sys.modules:
        return _libcuda_loaded()
    return False


def _libcuda_loaded() -> bool:
    """Whether the driver library is in the process. Asked of the dynamic loader
    without loading anything (RTLD_NOLOAD): this runs every second in the job,
    where reading /proc/self/maps would scan thousands of lines each time."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    return True


def foreign_profiler() -> str:
    """The name of a profiler of the job's own that needs CUPTI now, or ""."""
    # torch._C._autograd._profiler_enabled() answers for the calling thread only, and
    # this runs on the probe's: torch.autograd.profiler's module flag is process-wide.
    torch_profiler = sys.modules.get("torch.autograd.profiler")
    if getattr(torch_profiler, "_is_profiler_enabled", False) is True:
        return profiler_yield.TORCH_PROFILER
    tf_profiler = sys.modules.get("tensorflow.python.profiler.profiler_v2")
    if getattr(tf_profiler, "_profiler", None) is not None:
        return profiler_yield.TENSORFLOW_PROFILER
    return ""


def injection_library(environ: Mapping[str, str]) -> str:
    """The tool that injected itself into CUDA (Nsight Systems or Compute, or any
    CUDA_INJECTION64_PATH library), or "". It uses CUPTI for the job's whole life."""
    if environ.get("CUDA_INJECTION64_PATH") or environ.get("NSYS_PROFILING_SESSION_ID"):
        return cupti_versions.holder_hint(dict(environ))
    return ""


def device_uuids() -> dict[str, str]:
    """CUDA device ordinal -> its UUID, so the agent can label it as NVML does."""
    torch = sys.modules.get("torch")
    found: dict[str, str] = {}
    with contextlib.suppress(Exception):
        if torch is not None and torch.cuda.is_initialized():
            for ordinal in range(torch.cuda.device_count()):
                uuid = str(torch.cuda.get_device_properties(ordinal).uuid)
                found[str(ordinal)] = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    return found


