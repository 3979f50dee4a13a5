"""The build's one addition to pyproject.toml: dlprof_agent_probe.pth goes into
site-packages beside the package, where Python reads it at every start. Its one
line starts the sleeping probe when DLPROF_PROBE is set, and with the variable
unset it imports nothing (docs/deploy.md, "A probe at launch")."""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

LAUNCH_HOOK = os.path.join("dlprof_agent", "probe", "preload", "dlprof_agent_probe.pth")


class BuildWithLaunchHook(build_py):
    """build_py, plus the .pth at the top of the build, which a wheel installs
    into the top of site-packages (a .pth inside the package is never read)."""

    def run(self) -> None:
        super().run()
        self.copy_file(LAUNCH_HOOK, self._hook_output())

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), self._hook_output()]

    def _hook_output(self) -> str:
        return os.path.join(self.build_lib, os.path.basename(LAUNCH_HOOK))


setup(cmdclass={"build_py": BuildWithLaunchHook})
