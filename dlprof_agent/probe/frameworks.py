"""Which frameworks the job has imported completely, and the hooks for each.

The probe thread never imports a framework module itself: doing so while the
job's main thread is still importing the framework breaks that import. So a
framework counts only once every module its hooks use is in ``sys.modules`` and
has finished executing.
"""

from __future__ import annotations

import sys

# Framework -> the module and class of its hooks (loaded only once it is imported).
FRAMEWORK_HOOKS = (("torch", "dlprof_agent.probe.torch_hooks", "TorchHooks"),
                   ("tensorflow", "dlprof_agent.probe.tensorflow_hooks", "TensorFlowHooks"))
# What the hooks use.
REQUIRED_MODULES = {
    "torch": ("torch", "torch.nn.modules.module", "torch.optim.optimizer"),
    "tensorflow": ("tensorflow",),
}


def imported(names: tuple[str, ...]) -> bool:
    """True once every module is in sys.modules and has finished executing."""
    for name in names:
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None)
        if module is None or getattr(spec, "_initializing", False):
            return False
    return True


def framework_imported(framework: str) -> bool:
    """``framework`` (a key of REQUIRED_MODULES) is imported, completely."""
    return imported(REQUIRED_MODULES[framework])
