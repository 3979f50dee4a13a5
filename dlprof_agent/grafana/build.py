"""The shipped Grafana dashboards, built with the grafana-foundation-sdk.

`dashboards()` returns every dashboard's JSON model by file name; `write()`
stores them in `dashboards/` next to this module, where the package ships them.
Regenerate after a change with:

    python -m dlprof_agent.grafana.build [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dlprof_agent.grafana.gpu import build_gpu
from dlprof_agent.grafana.job import build_job
from dlprof_agent.grafana.layers import build_layers
from dlprof_agent.grafana.overview import build_overview
from dlprof_agent.grafana.threads import build_threads

DEFAULT_DIRECTORY = Path(__file__).parent / "dashboards"


def dashboards() -> dict[str, dict[str, Any]]:
    """Every shipped dashboard by its file name."""
    return {"overview.json": build_overview(), "layers.json": build_layers(),
            "threads.json": build_threads(), "gpu.json": build_gpu(), "job.json": build_job()}


def render(model: dict[str, Any]) -> str:
    """A model as the text of its file."""
    return json.dumps(model, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write(directory: Path) -> list[Path]:
    """Write every dashboard into `directory`; return the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, model in dashboards().items():
        path = directory / name
        path.write_text(render(model), encoding="utf-8")
        written.append(path)
    return written


def panels(model: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of a model that is not a row, also those inside collapsed rows."""
    for panel in model.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def queries(model: dict[str, Any]) -> list[str]:
    """Every PromQL `expr` of a model's panels, in panel order."""
    return [target["expr"] for panel in panels(model)
            for target in panel.get("targets", []) if "expr" in target]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dlprof_agent.grafana.build",
        description="Write the Grafana dashboards as JSON.")
    parser.add_argument("--out", type=Path, default=DEFAULT_DIRECTORY, metavar="DIR",
                        help="folder to write into (default: %(default)s)")
    args = parser.parse_args(argv)
    for path in write(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
