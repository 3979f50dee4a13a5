"""Which CUPTI the job may use: the version its framework ships or loaded, the
cupti-python that matches it, and who else may hold CUPTI. Asked of package
metadata, ``/proc/self/maps`` and the environment; loads nothing (the CUPTI
itself is ``cupti_binding``'s)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import sys


def framework_cupti_version(framework_cuda: str | None,
                            maps: list[str] | None = None) -> str:
    """The version of the CUPTI the framework ships or loaded, as exactly as known:
    the nvidia-cuda-cupti wheel's (13.0.85), else the loaded libcupti's file name,
    else the framework's CUDA version (13.0)."""
    major = (framework_cuda or "").split(".")[0]
    for name in ("nvidia-cuda-cupti", f"nvidia-cuda-cupti-cu{major}"):
        with contextlib.suppress(Exception):
            version = importlib.metadata.version(name)
            if not major or version.split(".")[0] == major:
                return version
    for path in loaded_libcupti() if maps is None else maps:
        found = re.search(r"libcupti\.so\.(\d+\.\d+(?:\.\d+)?)$", path)
        if found and (not major or found.group(1).split(".")[0] == major):
            return found.group(1)
    return framework_cuda or ""


def install_command(cupti_version: str) -> str:
    """The pip command for the cupti-python that leaves the job's CUPTI as it is.
    cupti-python X.Y requires nvidia-cuda-cupti~=X.Y, so a newer minor replaces the
    CUPTI the framework was built with (cupti-python 13.4 beside torch's 13.0.85
    pulls CUPTI 13.4); the job's own major.minor keeps it."""
    parts = cupti_version.split(".")
    if len(parts) < 2 or not all(part.isdigit() for part in parts[:2]):
        return "pip install 'cupti-python==X.Y.*' for the framework's CUDA X.Y"
    return f"pip install 'cupti-python=={parts[0]}.{parts[1]}.*'"


def cuda_mismatch(cupti_python_version: str, framework: str, framework_cuda: str | None,
                  cupti_version: str | None = None) -> str | None:
    """Why cupti-python of this version must not be loaded beside a framework built
    for ``framework_cuda`` (one CUPTI per process, of the framework's CUDA major)."""
    if not framework_cuda:
        return None
    ours = cupti_python_version.split(".", maxsplit=1)[0]
    theirs = framework_cuda.split(".")[0]
    if ours == theirs:
        return None
    return (f"cupti-python {cupti_python_version} is for CUDA {ours} but {framework} uses "
            f"CUDA {framework_cuda}: {install_command(cupti_version or framework_cuda)} in "
            "the job's environment")


def holder_hint(environ: dict[str, str]) -> str:
    """Who else may hold CUPTI, for CUPTI versions that do not say."""
    injection = environ.get("CUDA_INJECTION64_PATH", "")
    if "ToolsInjection" in injection or environ.get("NSYS_PROFILING_SESSION_ID"):
        return "Nsight Systems"
    if "ncu" in injection.lower() or "nsight-compute" in injection.lower():
        return "Nsight Compute"
    if injection:
        return f"the injection library {os.path.basename(injection)}"
    return "another CUPTI client (torch.profiler, Nsight, TensorFlow's profiler, DCGM)"


def loaded_libcupti() -> list[str]:
    paths = set()
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            if "/libcupti.so" in path:
                paths.add(os.path.realpath(path))
    return sorted(paths)


def framework_cuda() -> tuple[str, str | None]:
    """The framework in use and the CUDA version it was built for."""
    torch = sys.modules.get("torch")
    version = getattr(getattr(torch, "version", None), "cuda", None)
    if version:
        return "torch", str(version)
    tensorflow = sys.modules.get("tensorflow")
    if tensorflow is not None:
        with contextlib.suppress(Exception):
            info = tensorflow.sysconfig.get_build_info()
            if info.get("cuda_version"):
                return "tensorflow", str(info["cuda_version"])
    return "", None
