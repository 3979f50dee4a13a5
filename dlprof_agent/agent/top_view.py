"""`top`'s screen, drawn with Rich from a ``Frame`` (top_frame.py): the step
(rate, time, history, split), layers, kernels, CPU and threads, GPUs and the
live findings. Panels are laid out for the terminal's size: two columns when it
is wide, one when it is not, and a panel that does not fit is left out whole,
lowest priority first, so that what is drawn is never cut through."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dlprof_agent.agent.status import format_bytes, format_evidence
from dlprof_agent.agent.top_frame import Frame, TargetRow

SPARKS = "▁▂▃▄▅▆▇█"
PHASE_STYLES = {"forward": "green", "backward": "blue", "optimizer": "magenta",
                "exchange": "red", "other": "yellow", "unsplit": "white"}
SEVERITY_STYLES = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
SORTS = ("time", "name")  # what `s` cycles through: the tables' order
WIDE_COLUMNS = 110  # two columns from this width
MIN_COLUMNS = 40
KEYS = "q quit  l layers on/off  s sort  ? help"
HELP = (
    ("q", "quit, with the summary that `attach` prints (Ctrl-C does the same)"),
    ("l", "turn layer timing on or off in the job (as --layers, within --layers-budget)"),
    ("s", "sort layers, kernels and threads by time, or by name"),
    ("?", "show or hide this help"),
)


@dataclass
class ViewState:
    """What the keys change, and the short history the sparkline draws."""

    sort: str = "time"
    help: bool = False
    message: str = ""  # the last thing said: a key's effect, an agent's log line
    note: str = ""  # what the probe's start waits for, while it runs
    history: list[float] = field(default_factory=list)  # steps/s, oldest first
    history_length: int = 60

    def remember(self, frame: Frame) -> None:
        if frame.steps_per_second is not None:
            self.history.append(frame.steps_per_second)
            del self.history[:-self.history_length]


def sparkline(values: Sequence[float], width: int) -> str:
    values = list(values)[-width:]
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int(value / top * (len(SPARKS) - 1) + 0.5))]
                   for value in values)


def _ms(seconds: float | None) -> str:
    return "…" if seconds is None else f"{1000 * seconds:.1f} ms"


def _rate(value: float | None, unit: str) -> str:
    return "…" if value is None else f"{value:,.1f} {unit}"


def split_bar(split: Sequence[tuple[str, float]], width: int) -> Text:
    """The step split as one bar, a share of ``width`` cells per phase."""
    bar = Text()
    used = 0
    for index, (phase, share) in enumerate(split):
        cells = width - used if index == len(split) - 1 else round(share * width)
        cells = max(0, min(cells, width - used))
        bar.append("█" * cells, style=PHASE_STYLES.get(phase, "white"))
        used += cells
    return bar


def _step_panel(frame: Frame, state: ViewState, width: int) -> Panel:
    body = Text()
    body.append("steps/s ", style="dim")
    body.append(_rate(frame.steps_per_second, ""), style="bold")
    body.append("  step ", style="dim")
    body.append(_ms(frame.step_seconds), style="bold")
    body.append("  samples/s ", style="dim")
    body.append(_rate(frame.samples_per_second, ""), style="bold")
    body.append(f"  ({frame.steps_total} steps)", style="dim")
    lines: list[RenderableType] = [body]
    if state.history:
        lines.append(Text(sparkline(state.history, max(10, width - 4)), style="cyan"))
    if frame.split:
        why = ("" if frame.split_state in ("split", "")
               else f"not split: {frame.split_state.removeprefix('not split: ')}")
        lines.append(split_bar(frame.split, max(10, width - 4)))
        legend = Text()
        for phase, share in frame.split:
            legend.append("■ ", style=PHASE_STYLES.get(phase, "white"))
            legend.append(f"{phase} {share:.0%}  ")
        if why:
            legend.append(why, style="yellow")
        lines.append(legend)
    elif frame.probe == "none" and state.note:
        lines.append(Text(f"probe: {state.note}", style="yellow"))
    elif frame.probe == "none":
        lines.append(Text("no probe in this process: steps, split and layers need one "
                          "(a Python job)", style="dim"))
    else:
        lines.append(Text("split: waiting for steady steps", style="dim"))
    return Panel(Group(*lines), title="step", title_align="left", box=box.ROUNDED)


def _table(*columns: tuple[str, str]) -> Table:
    table = Table(box=None, pad_edge=False, expand=True, show_edge=False)
    for name, justify in columns:
        table.add_column(name, justify=justify,  # type: ignore[arg-type]
                         no_wrap=True, overflow="ellipsis", ratio=3 if justify == "left"
                         else None)
    return table


def _layers_panel(frame: Frame, state: ViewState, rows: int) -> Panel | None:
    if frame.layer_timing != "on" and not frame.layers:
        text = ("layer timing is off: press l to turn it on (or attach with --layers)"
                if frame.probe != "none" else "")
        return Panel(Text(text, style="dim"), title="layers", title_align="left") \
            if text else None
    layers = sorted(frame.layers, key=(lambda row: row.name) if state.sort == "name"
                    else (lambda row: -row.step_ratio))
    table = _table(("layer", "left"), ("of step", "right"), ("fwd", "right"),
                   ("bwd", "right"))
    for row in layers[:rows]:
        table.add_row(row.name, f"{row.step_ratio:.0%}", _ms(row.forward_seconds),
                      _ms(row.backward_seconds))
    if not layers:
        table.add_row(Text("timing the layers: the first timed steps come soon",
                           style="dim"), "", "", "")
    return Panel(table, title=f"layers ({len(layers)})", title_align="left")


def _kernels_panel(frame: Frame, state: ViewState, rows: int) -> Panel | None:
    if not frame.kernels and not frame.memcpy:
        if not frame.gpu_available or not frame.kernel_state:
            return None
        return Panel(Text(f"kernel tracing {frame.kernel_state}", style="dim"),
                     title="kernels", title_align="left")
    kernels = sorted(frame.kernels, key=(lambda row: row.name) if state.sort == "name"
                     else (lambda row: -row.busy_ratio))
    table = _table(("kernel", "left"), ("gpu", "right"), ("busy", "right"))
    for row in kernels[:rows]:
        table.add_row(row.name, row.gpu, f"{row.busy_ratio:.1%}")
    for kind, rate in frame.memcpy:
        table.add_row(f"[memcpy {kind}]", "", f"{format_bytes(rate)}/s")
    return Panel(table, title="kernels and copies", title_align="left")


def _cpu_panel(frame: Frame, state: ViewState, rows: int) -> Panel:
    head = Text()
    head.append("cores ", style="dim")
    for mode, cores in frame.cpu_cores:
        head.append(f"{mode} ", style="dim")
        head.append(f"{cores:.2f}  ", style="bold")
    if not frame.cpu_cores:
        head.append("…  ", style="dim")
    head.append("rss ", style="dim")
    head.append(format_bytes(frame.rss_bytes) if frame.rss_bytes is not None else "?",
                style="bold")
    if frame.rss_peak_bytes is not None:
        head.append(f" (peak {format_bytes(frame.rss_peak_bytes)})", style="dim")
    threads = sorted(frame.threads, key=(lambda row: row.name) if state.sort == "name"
                     else (lambda row: (-row.cores, row.name)))
    table = _table(("thread", "left"), ("n", "right"), ("cpu", "right"))
    for row in threads[:rows]:
        table.add_row(row.name, str(row.threads), f"{row.cores:.0%}")
    return Panel(Group(head, table), title="cpu and memory", title_align="left")


def _gpu_panel(frame: Frame) -> Panel | None:
    if not frame.gpus:
        return None
    table = _table(("gpu", "left"), ("util", "right"), ("memory", "right"),
                   ("power", "right"), ("sm clock", "right"))
    for gpu in frame.gpus:
        memory = ("?" if gpu.memory_used_bytes is None else
                  format_bytes(gpu.memory_used_bytes) + (
                      f" / {format_bytes(gpu.memory_total_bytes)}"
                      if gpu.memory_total_bytes else ""))
        table.add_row(f"{gpu.gpu} {gpu.name}",
                      "?" if gpu.utilization_ratio is None else f"{gpu.utilization_ratio:.0%}",
                      memory, "?" if gpu.power_watts is None else f"{gpu.power_watts:.0f} W",
                      "?" if gpu.sm_clock_hertz is None else
                      f"{gpu.sm_clock_hertz / 1e6:.0f} MHz")
    return Panel(table, title="gpus", title_align="left")


def _findings_panel(frame: Frame, rows: int) -> Panel:
    if not frame.findings:
        return Panel(Text("none now", style="dim"), title="findings", title_align="left")
    lines: list[RenderableType] = []
    for finding in frame.findings[:max(1, rows // 3)]:
        line = Text()
        line.append(f"{finding.severity} ", style=SEVERITY_STYLES.get(finding.severity, ""))
        line.append(f"{finding.id}: ", style="bold")
        line.append(finding.summary)
        lines.append(line)
        if finding.evidence:
            lines.append(Text("  " + ", ".join(format_evidence(q, v)
                                               for q, v in finding.evidence[:4]), style="dim"))
        if finding.advice:
            lines.append(Text(f"  try: {finding.advice}", style="green"))
    return Panel(Group(*lines), title=f"findings ({len(frame.findings)})", title_align="left")


# Measures panels only: it renders into lines and writes nothing.
_MEASURE = Console(file=io.StringIO(), width=200, color_system=None, legacy_windows=False)


def _height(panel: RenderableType, width: int) -> int:
    """Lines ``panel`` takes at ``width``, as Rich lays it out."""
    return len(_MEASURE.render_lines(panel, _MEASURE.options.update(width=width), pad=False))


def _fit(panels: Sequence[tuple[int, Panel | None]], width: int, height: int) -> list[Panel]:
    """The panels that fit in ``height`` lines, in their order; leaves out the
    lowest-priority ones (the highest number) first."""
    present = [(priority, panel) for priority, panel in panels if panel is not None]
    heights = {id(panel): _height(panel, width) for _, panel in present}
    kept = list(present)
    while kept and sum(heights[id(panel)] for _, panel in kept) > height:
        kept.remove(max(kept, key=lambda item: item[0]))
    return [panel for _, panel in kept]


def header(frame: Frame) -> Text:
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append(" dlprof-agent top ", style="bold reverse")
    line.append(f" pid {frame.pid} {frame.name}", style="bold")
    if frame.who:
        line.append(f"  {frame.who}")
    line.append("  probe ", style="dim")
    line.append(frame.probe, style="green" if frame.probe == "up" else "yellow")
    if not frame.up:
        line.append("  exited", style="bold red")
    if frame.agent_cores is not None:
        line.append(f"  agent cpu {frame.agent_cores:.1%}", style="dim")
    return line


def render(frame: Frame, state: ViewState, width: int, height: int) -> RenderableType:
    """The whole screen for a terminal of ``width`` x ``height``."""
    width = max(width, MIN_COLUMNS)
    footer = Text(KEYS + (f"   {state.message}" if state.message else ""), style="dim",
                  no_wrap=True, overflow="ellipsis")
    body_height = max(3, height - 2)
    if state.help:
        table = _table(("key", "left"), ("does", "left"))
        for key, does in HELP:
            table.add_row(key, does)
        return Group(header(frame), Panel(table, title="help", title_align="left"), footer)
    rows = max(3, body_height // 3)
    wide = width >= WIDE_COLUMNS
    column = width // 2 if wide else width
    left = [(0, _step_panel(frame, state, column)), (3, _layers_panel(frame, state, rows)),
            (5, _kernels_panel(frame, state, rows))]
    right = [(1, _findings_panel(frame, rows)), (2, _cpu_panel(frame, state, rows)),
             (4, _gpu_panel(frame))]
    if wide:
        grid = Table.grid(expand=True)
        grid.add_column(ratio=1)
        grid.add_column(ratio=1)
        grid.add_row(Group(*_fit(left, column, body_height)),
                     Group(*_fit(right, width - column, body_height)))
        body: RenderableType = grid
    else:
        ordered = sorted(left + right, key=lambda item: item[0])
        body = Group(*_fit(ordered, width, body_height))
    return Group(header(frame), body, footer)


def render_targets(rows: Sequence[TargetRow], chosen: int, url: str) -> RenderableType:
    """A daemon's jobs: ↑/↓ choose one, Enter opens it."""
    table = Table(box=box.SIMPLE_HEAD, expand=True)
    for name, justify in (("pid", "right"), ("job", "left"), ("rank", "right"),
                          ("steps/s", "right"), ("own step", "right"), ("state", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for index, row in enumerate(rows):
        table.add_row(str(row.pid), row.job or "-", row.rank or "-",
                      _rate(row.steps_per_second, ""), _ms(row.own_step_seconds),
                      Text("up", style="green") if row.up else Text("down", style="red"),
                      style="reverse" if index == chosen else None)
    title = Text(f" dlprof-agent top  {url}: {len(rows)} targets ", style="bold reverse")
    return Group(title, table, Text("↑/↓ choose  Enter open  q quit", style="dim"))
