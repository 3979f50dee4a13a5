"""--layers-budget and --layers-every: parsed, checked, and passed to the probe."""

from __future__ import annotations

import pytest

from dlprof_agent.cli.main import build_parser
from dlprof_agent.probe.session import DEFAULT_OPTIONS
from dlprof_agent.probe.session import checked_options as _options
from dlprof_agent.probe_link.connect import ProbeOptions, _start_options


@pytest.mark.parametrize(("text", "fraction"), [("1%", 0.01), ("0.5%", 0.005), ("0.02", 0.02),
                                                ("100%", 1.0)])
def test_the_budget_is_a_percentage_or_a_fraction(text: str, fraction: float) -> None:
    args = build_parser().parse_args(["attach", "1", "--layers", "--layers-budget", text])
    assert args.layers_budget == pytest.approx(fraction)


@pytest.mark.parametrize("argv", [["--layers-budget", "0"], ["--layers-budget", "150%"],
                                  ["--layers-budget", "cheap"], ["--layers-every", "0"]])
def test_bad_values_are_one_line_errors(argv: list[str], capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["attach", "1", "--layers", *argv])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("dlprof-agent") and argv[0] in error


def test_the_probe_is_told_only_what_differs_from_its_defaults() -> None:
    assert "layers_budget" not in _start_options(ProbeOptions(layers=True), 1.0)
    started = _start_options(ProbeOptions(layers=True, layers_budget=0.05, layers_every=4), 1.0)
    assert started["layers_budget"] == 0.05 and started["layers_every"] == 4
    merged = _options({k: v for k, v in started.items() if k != "agent_pid"}, DEFAULT_OPTIONS)
    assert (merged["layers_budget"], merged["layers_every"]) == (0.05, 4)
    for bad in ({"layers_budget": 0}, {"layers_budget": 2.0}, {"layers_every": -1},
                {"layers_every": True}):
        with pytest.raises(ValueError):
            _options(bad, DEFAULT_OPTIONS)


@pytest.mark.parametrize(("command", "target"), [(["attach"], ["1"]),
                                                (["daemon"], ["--match", "train"]),
                                                (["run"], ["--", "python", "train.py"])])
def test_the_step_split_is_on_unless_turned_off(command: list[str], target: list[str]) -> None:
    parser = build_parser()
    assert ProbeOptions().split and parser.parse_args([*command, *target]).split
    assert not parser.parse_args([*command, "--no-split", *target]).split
    assert "split" not in _start_options(ProbeOptions(), 1.0)  # an older probe knows no split
    started = _start_options(ProbeOptions(split=False), 1.0)
    assert started["split"] is False
    assert not _options({"split": False}, DEFAULT_OPTIONS)["split"]
    assert DEFAULT_OPTIONS["split"]
    with pytest.raises(ValueError):
        _options({"split": 1}, DEFAULT_OPTIONS)
