"""`top`'s screen, drawn with Rich from a ``Frame`` (top_frame.py): the step
(rate, time, history, split), layers, kernels, CPU and threads, GPUs and the
live findings. Panels are laid out for the terminal's size: two columns when it
is wide, one when it is not. Where they do not fit, the tables shorten first and
then a panel is left out whole, lowest priority first, so that a short terminal
still shows some of everything it can and what is drawn is never cut through."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from dlprof_agent.agent.status import format_bytes, format_evidence
from dlprof_agent.agent.top_frame import Frame, TargetRow

SPARKS = "▁▂▃▄▅▆▇█"
PHASE_STYLES = {"forward": "green", "backward": "blue", "compiled": "cyan",
                "optimizer": "magenta", "exchange": "red", "other": "yellow",
                "unsplit": "white"}
SEVERITY_STYLES = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
SORTS = ("time", "name")  # what `s` cycles through: the tables' order
WIDE_COLUMNS = 110  # two columns from this width
MIN_COLUMNS = 40
MIN_TABLE_ROWS = 3  # a table shortened to fit keeps this many rows (findings: one)
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
    return "…" if value is None else f"{value:,.1f} {unit}".rstrip()


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


class Lines:
    """A panel's content as lines that never wrap, each cut to the panel's inner
    width, and boxed by ``panel`` into lines of the panel's whole width: the screen
    is then one Text, which Rich draws without a layout pass (a Panel in a Table
    grid measured, padded and cropped every cell again at each refresh, and cost
    the agent more than the rest of the refresh together)."""

    def __init__(self, width: int) -> None:
        self.width = max(1, width)
        self.lines: list[Text] = []

    def add(self, line: Text | str, style: str = "") -> None:
        text = line if isinstance(line, Text) else Text(line, style=style)
        text.truncate(self.width, overflow="ellipsis")
        self.lines.append(text)

    def rows(self, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        """A table: the first column takes what the others leave, cut with …;
        the others are right-aligned to their widest cell."""
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(1, len(header))]
        first = max(4, self.width - sum(width + 2 for width in widths))
        for index, row in enumerate([header, *rows]):
            name = row[0] if len(row[0]) <= first else row[0][:first - 1] + "…"
            cells = "".join(f"  {cell:>{width}}"
                            for cell, width in zip(row[1:], widths, strict=True))
            self.add(f"{name:<{first}}{cells}", style="dim" if index == 0 else "")

    def panel(self, title: str) -> list[Text]:
        """The lines in a rounded box titled ``title``, as Rich's Panel draws one."""
        inner = self.width
        title = title if len(title) <= inner - 2 else title[:inner - 3] + "…"
        boxed = [Text(f"╭─ {title} {'─' * (inner - len(title) - 1)}╮")]
        for line in self.lines:
            row = Text("│ ")
            row.append_text(line)
            row.append(" " * (inner - line.cell_len) + " │")
            boxed.append(row)
        boxed.append(Text(f"╰{'─' * (inner + 2)}╯"))
        return boxed

    @property
    def height(self) -> int:
        return len(self.lines) + 2  # and the borders


Sized = tuple[list[Text], int]  # a panel's lines and its height
Builder = Callable[[int], "Sized | None"]  # a panel drawn with at most so many table rows


def _step_panel(frame: Frame, state: ViewState, width: int) -> Sized:
    lines = Lines(width - 4)
    body = Text()
    body.append("steps/s ", style="dim")
    body.append(_rate(frame.steps_per_second, ""), style="bold")
    body.append("  step ", style="dim")
    body.append(_ms(frame.step_seconds), style="bold")
    body.append("  samples/s ", style="dim")
    body.append(_rate(frame.samples_per_second, ""), style="bold")
    body.append(f"  ({frame.steps_total} steps)", style="dim")
    lines.add(body)
    if state.history:
        lines.add(sparkline(state.history, lines.width), style="cyan")
    if frame.split:
        why = ("" if frame.split_state in ("split", "")
               else f"not split: {frame.split_state.removeprefix('not split: ')}")
        lines.add(split_bar(frame.split, lines.width))
        legend = Text()
        for phase, share in frame.split:
            legend.append("■ ", style=PHASE_STYLES.get(phase, "white"))
            legend.append(f"{phase} {share:.0%}  ")
        if why:
            legend.append(why, style="yellow")
        lines.add(legend)
    elif frame.probe == "none" and state.note:
        lines.add(f"probe: {state.note}", style="yellow")
    elif frame.probe == "none":
        lines.add("no probe in this process: steps, split and layers need one (a Python "
                  "job)", style="dim")
    else:
        lines.add("split: waiting for steady steps", style="dim")
    return lines.panel("step"), lines.height


def _layers_panel(frame: Frame, state: ViewState, width: int, rows: int) -> Sized | None:
    lines = Lines(width - 4)
    if frame.layer_timing != "on" and not frame.layers:
        if frame.probe == "none":
            return None
        lines.add(f"layer timing is {frame.layer_timing}" if frame.layer_timing.startswith(
            "unavailable") else "layer timing is off: press l to turn it on (or attach with "
            "--layers)", style="dim")
        return lines.panel("layers"), lines.height
    layers = sorted(frame.layers, key=(lambda row: row.name) if state.sort == "name"
                    else (lambda row: -row.step_ratio))
    if not layers:
        lines.add("timing the layers: the first timed steps come soon", style="dim")
    else:
        lines.rows(("layer", "of step", "fwd", "bwd"),
                   [(row.name, f"{row.step_ratio:.0%}", _ms(row.forward_seconds),
                     _ms(row.backward_seconds)) for row in layers[:rows]])
    return lines.panel(f"layers ({len(layers)})"), lines.height


def _kernels_panel(frame: Frame, state: ViewState, width: int, rows: int) -> Sized | None:
    lines = Lines(width - 4)
    if not frame.kernels and not frame.memcpy:
        if not frame.gpu_available or not frame.kernel_state:
            return None
        lines.add(f"kernel tracing {frame.kernel_state}", style="dim")
        return lines.panel("kernels"), lines.height
    kernels = sorted(frame.kernels, key=(lambda row: row.name) if state.sort == "name"
                     else (lambda row: -row.busy_ratio))
    lines.rows(("kernel", "gpu", "busy"),
               [(row.name, row.gpu, f"{row.busy_ratio:.1%}") for row in kernels[:rows]]
               + [(f"[memcpy {kind}]", "", f"{format_bytes(rate)}/s")
                  for kind, rate in frame.memcpy])
    return lines.panel("kernels and copies"), lines.height


def _cpu_panel(frame: Frame, state: ViewState, width: int, rows: int) -> Sized:
    lines = Lines(width - 4)
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
    lines.add(head)
    threads = sorted(frame.threads, key=(lambda row: row.name) if state.sort == "name"
                     else (lambda row: (-row.cores, row.name)))
    lines.rows(("thread", "n", "cpu"),
               [(row.name, str(row.threads), f"{row.cores:.0%}") for row in threads[:rows]])
    return lines.panel("cpu and memory"), lines.height


def _gpu_panel(frame: Frame, width: int) -> Sized | None:
    if not frame.gpus:
        return None
    lines = Lines(width - 4)
    rows = []
    for gpu in frame.gpus:
        memory = ("?" if gpu.memory_used_bytes is None else
                  format_bytes(gpu.memory_used_bytes) + (
                      f" / {format_bytes(gpu.memory_total_bytes)}"
                      if gpu.memory_total_bytes else ""))
        rows.append((f"{gpu.gpu} {gpu.name}",
                     "?" if gpu.utilization_ratio is None else f"{gpu.utilization_ratio:.0%}",
                     memory, "?" if gpu.power_watts is None else f"{gpu.power_watts:.0f} W",
                     "?" if gpu.sm_clock_hertz is None else
                     f"{gpu.sm_clock_hertz / 1e6:.0f} MHz"))
    lines.rows(("gpu", "util", "memory", "power", "sm clock"), rows)
    return lines.panel("gpus"), lines.height


def _findings_panel(frame: Frame, width: int, rows: int) -> Sized:
    lines = Lines(width - 4)
    if not frame.findings:
        lines.add("none now", style="dim")
        return lines.panel("findings"), lines.height
    for finding in frame.findings[:max(1, rows // 3)]:
        line = Text()
        line.append(f"{finding.severity} ", style=SEVERITY_STYLES.get(finding.severity, ""))
        line.append(f"{finding.id}: ", style="bold")
        line.append(finding.summary)
        lines.add(line)
        if finding.evidence:
            lines.add("  " + ", ".join(format_evidence(q, v) for q, v in finding.evidence[:4]),
                      style="dim")
        if finding.advice:
            lines.add(f"  try: {finding.advice}", style="green")
    return lines.panel(f"findings ({len(frame.findings)})"), lines.height


def _fit(panels: Sequence[tuple[int, Builder]], height: int, rows: int) -> list[Text]:
    """The panels, in their order, drawn with up to ``rows`` table rows each and
    fitted into ``height`` lines: the lowest-priority panels (the highest number)
    first lose table rows, down to MIN_TABLE_ROWS, then are left out whole."""
    builders = dict(panels)
    sized = {priority: build(rows) for priority, build in panels}

    def excess() -> int:
        return sum(drawn[1] for drawn in sized.values() if drawn is not None) - height

    for priority in sorted(sized, reverse=True):
        shortened = rows
        while sized[priority] is not None and excess() > 0 and shortened > MIN_TABLE_ROWS:
            shortened -= 1
            sized[priority] = builders[priority](shortened)
    while excess() > 0:
        del sized[max(priority for priority, drawn in sized.items() if drawn is not None)]
    return [line for priority, _ in panels
            if (drawn := sized.get(priority)) is not None for line in drawn[0]]


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
        lines = Lines(width - 4)
        for key, does in HELP:
            lines.add(f"{key}  {does}")
        return _screen([header(frame), *lines.panel("help"), footer], width)
    rows = max(3, body_height // 3)
    wide = width >= WIDE_COLUMNS
    left_width = width // 2 if wide else width
    right_width = width - left_width if wide else width
    left: list[tuple[int, Builder]] = [
        (0, lambda _: _step_panel(frame, state, left_width)),
        (3, lambda rows: _layers_panel(frame, state, left_width, rows)),
        (5, lambda rows: _kernels_panel(frame, state, left_width, rows))]
    right: list[tuple[int, Builder]] = [
        (1, lambda rows: _findings_panel(frame, right_width, rows)),
        (2, lambda rows: _cpu_panel(frame, state, right_width, rows)),
        (4, lambda _: _gpu_panel(frame, right_width))]
    if wide:
        left_lines, right_lines = _fit(left, body_height, rows), _fit(right, body_height, rows)
        blank = Text(" " * left_width)
        body = []
        for index in range(max(len(left_lines), len(right_lines))):
            line = (left_lines[index] if index < len(left_lines) else blank).copy()
            if index < len(right_lines):
                line.append_text(right_lines[index])
            body.append(line)
    else:
        body = _fit(sorted(left + right, key=lambda item: item[0]), body_height, rows)
    return _screen([header(frame), *body, footer], width)


class ScreenLines:
    """The screen's lines, each already cut to its width: Rich draws their styled
    segments as they are, with no wrapping or measuring pass."""

    def __init__(self, lines: list[Text]) -> None:
        self.lines = lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        newline = Segment.line()
        for line in self.lines:
            yield from line.render(console)
            yield newline


def _screen(lines: list[Text], width: int) -> ScreenLines:
    for line in lines:
        line.truncate(width, overflow="ellipsis")
    return ScreenLines(lines)


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
