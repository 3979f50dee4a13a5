"""`top`'s screen without a terminal: frames built from the agent's real
collector reading a real process, laid out at every size, and the command's
one-line errors."""

from __future__ import annotations

import dataclasses
import io
import os
import time
from pathlib import Path

import pytest
from rich.console import Console

from dlprof_agent.agent.core import AgentOptions
from dlprof_agent.agent.serve import make_agent
from dlprof_agent.agent.top_frame import (
    FindingRow,
    Frame,
    LayerRow,
    TargetRow,
    build_frame,
    target_pids,
)
from dlprof_agent.agent.top_screen import TopScreen, split_keys
from dlprof_agent.agent.top_view import ViewState, render, sparkline, split_bar
from dlprof_agent.cli.main import main
from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import ExitCode
from dlprof_agent.exporters.metrics_reader import Readings, collected
from dlprof_agent.exporters.prometheus import NodeCollector
from tests.conftest import free_port


@pytest.fixture(scope="module")
def two_reads() -> tuple[Readings, Readings]:
    """Two passes of a real agent over this process, some CPU apart."""
    agent = make_agent(Target.of(os.getpid()), AgentOptions(gpu=False, probe=None))
    collector = NodeCollector(lambda: agent.latest, interval_seconds=1.0)
    agent.sample_once()
    first = collected(collector)
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # CPU for the second pass to see
        pass
    agent.sample_once()
    return first, collected(collector)


def drawn(frame: Frame, width: int, height: int) -> list[str]:
    console = Console(file=io.StringIO(), width=width, height=height, color_system=None)
    with console.capture() as capture:
        console.print(render(frame, ViewState(), width, height))
    return capture.get().splitlines()


def test_a_frame_of_a_real_process_has_its_rates_and_no_probe_figures(
        two_reads: tuple[Readings, Readings]) -> None:
    first, second = two_reads
    assert target_pids(second) == [os.getpid()]
    frame = build_frame(second, first, os.getpid())
    assert frame.up and frame.probe == "none"
    assert frame.interval_seconds is not None and frame.interval_seconds > 0
    assert dict(frame.cpu_cores)["user"] + dict(frame.cpu_cores)["system"] > 0
    assert frame.rss_bytes and frame.rss_peak_bytes and frame.rss_peak_bytes >= frame.rss_bytes
    assert frame.threads and frame.steps_per_second is None and not frame.split
    # The first read alone: no rates yet, the rest already there.
    alone = build_frame(first, None, os.getpid())
    assert alone.cpu_cores == () and alone.rss_bytes


@pytest.mark.parametrize(("width", "height"), [(40, 12), (70, 30), (109, 20), (110, 45),
                                               (200, 60)])
def test_every_size_draws_whole_panels_within_the_terminal(
        two_reads: tuple[Readings, Readings], width: int, height: int) -> None:
    first, second = two_reads
    lines = drawn(build_frame(second, first, os.getpid()), width, height)
    assert "dlprof-agent top" in lines[0] and "q quit" in lines[-1]
    assert len(lines) <= height
    assert all(len(line) <= width for line in lines)
    # A panel left out is left out whole: every top border has its bottom border.
    assert sum(line.count("╭") for line in lines) == sum(line.count("╰") for line in lines)


def test_a_short_terminal_drops_the_lower_panels_first(
        two_reads: tuple[Readings, Readings]) -> None:
    first, second = two_reads
    frame = build_frame(second, first, os.getpid())
    tall = "\n".join(drawn(frame, 80, 60))
    short = "\n".join(drawn(frame, 80, 12))
    assert "step" in short and "cpu and memory" in tall
    assert "cpu and memory" not in short


def test_a_small_terminal_shortens_the_tables_before_it_leaves_a_panel_out(
        two_reads: tuple[Readings, Readings]) -> None:
    """80 x 24 with layer timing on and two findings: every panel is still drawn,
    the layers table cut to its top rows and one finding shown of two."""
    first, second = two_reads
    layers = tuple(LayerRow(f"features.{index} Conv2d", 0.09 - index / 200, 0.001, 0.002)
                   for index in range(10))
    findings = tuple(FindingRow(name, "warning", f"{name} summary", f"{name} advice",
                                (("allowed_cpus", 2.0),))
                     for name in ("cpu_contention", "thread_oversubscription"))
    frame = dataclasses.replace(build_frame(second, first, os.getpid()), probe="up",
                                layer_timing="on", layers=layers, findings=findings)
    screen = drawn(frame, 80, 24)
    text = "\n".join(screen)
    assert len(screen) <= 24
    assert "layers (10)" in text and "findings (2)" in text and "cpu and memory" in text
    assert "features.0 Conv2d" in text and "features.9 Conv2d" not in text
    assert "cpu_contention" in text and "thread_oversubscription" not in text
    # With the room, every row is drawn.
    assert "features.9 Conv2d" in "\n".join(drawn(frame, 80, 60))


def test_the_split_bar_fills_its_width_in_phase_order() -> None:
    bar = split_bar([("forward", 0.5), ("backward", 0.3), ("other", 0.2)], 20)
    assert bar.plain == "█" * 20
    assert [span.style for span in bar.spans] == ["green", "blue", "yellow"]
    line = sparkline([1.0, 2.0, 4.0, 0.0], 10)
    assert len(line) == 4 and line[0] < line[1] < line[2] == "█" and line[3] == "▁"
    assert sparkline(list(range(100)), 10) == sparkline(list(range(90, 100)), 10)


@pytest.mark.parametrize(("argv", "code", "words"), [
    (["top"], ExitCode.USAGE, "top needs a PID, or --url"),
    (["top", "--url", "node7:9945"], ExitCode.USAGE, "not an http:// or https:// address"),
])
def test_bad_arguments_are_one_line_errors(capsys: pytest.CaptureFixture[str],
                                           argv: list[str], code: int, words: str) -> None:
    assert main(argv) == code
    error = capsys.readouterr().err
    assert words in error and error.count("\n") == 1


def test_an_unreachable_url_is_one_line_and_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nothing listens there
    assert main(["top", "--url", f"http://127.0.0.1:{port}"]) == ExitCode.NO_TARGET
    error = capsys.readouterr().err
    assert f"cannot reach http://127.0.0.1:{port}/metrics" in error
    assert error.count("\n") == 1


def test_a_gpu_jobs_frame_has_its_kernels_and_its_gpu_from_a_real_h100_scrape() -> None:
    # Two scrapes of ResNet-50 training on an H100, 5 s apart (tests/test_findings.py).
    h100 = Path(__file__).parent / "data" / "h100-resnet50"
    first, second = (Readings.of_text((h100 / name).read_text())
                     for name in ("m1.txt", "m6.txt"))
    frame = build_frame(second, first, 2712)
    assert frame.interval_seconds is not None and 4.9 < frame.interval_seconds < 5.1
    assert frame.gpus and frame.gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert frame.kernels and all(0 < row.busy_ratio <= 1 for row in frame.kernels)
    assert frame.steps_per_second and frame.split
    lines = drawn(frame, 100, 80)  # one column: the gpus panel as wide as the screen
    screen = "\n".join(lines)
    assert "kernels and copies" in screen and "NVIDIA H100 80GB HBM3" in screen
    assert "at::native::vectorized_elementwise_kernel" in screen
    assert all(len(line) <= 100 for line in lines)


def test_keys_read_together_are_split_and_a_sequence_cut_short_waits_for_its_end() -> None:
    assert split_keys("\x1b[B\r") == (["\x1b[B", "\r"], "")
    assert split_keys("jj\x1bOAq") == (["j", "j", "\x1bOA", "q"], "")
    assert split_keys("\x1b[1;5B\x1b") == (["\x1b[1;5B", "\x1b"], "")  # ESC alone is a key
    assert split_keys("t\x1b[") == (["t"], "\x1b[")


def test_down_and_enter_in_one_read_open_the_second_target() -> None:
    rows = tuple(TargetRow(pid, "job", "", True, None, None) for pid in (101, 202, 303))
    screen = TopScreen(None, lambda: None)
    screen.targets = rows
    assert screen._key("\x1b[B\r") and screen.pid == 202 and not screen.choosing
    assert screen._key("t") and screen.choosing
    assert not screen._key("\x1b[")  # the rest of the arrow comes in the next read
    assert screen._key("B") and screen.chosen == 2
    assert screen._key("\x1bOA\n") and screen.pid == 202
    assert not screen.quit.is_set() and screen._key("q") and screen.quit.is_set()
