"""`dlprof-agent rules`: its default output is the shipped deploy/prometheus/rules.yml,
the options change what they say and nothing else, bad values are one-line errors,
and `promtool test rules` runs the job's cases (tests/data/promtool/) on what it
prints: the straggler alert names the slow rank and its cause, never a rank that
waits, and the stalled, missing-ranks, agent and probe alerts fire when they should."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from dlprof_agent.cli.main import main
from dlprof_agent.exporters import prometheus_rules
from dlprof_agent.exporters.prometheus_rules import Alert, Record, RuleOptions, rules_file
from tests.conftest import PROMTOOL

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "deploy" / "prometheus" / "rules.yml"
# Alerts held only seconds (STRAGGLER_FOR): the straggler, and the slow exchange on its
# higher bar, whose lower one holds --for inside its expression.
FAST_ALERTS = ("DlprofStragglerRank", "DlprofSlowExchange")
PROMTOOL_CASES = REPO / "tests" / "data" / "promtool" / "fleet_rules_test.yml"
# The straggler rules at deploy/'s pace (1 s scrape and evaluation).
PROMTOOL_SHORT_CASES = PROMTOOL_CASES.with_name("fleet_rules_short_test.yml")
REGENERATE = "regenerate with `dlprof-agent rules -o deploy/prometheus/rules.yml`"


def command(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(["rules", *args])
        except SystemExit as exit_:  # argparse's errors
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


def loaded(text: str) -> list[dict[str, Any]]:
    """Every rule of a rules file, as YAML reads it."""
    return [rule for group in yaml.safe_load(text)["groups"] for rule in group["rules"]]


def test_default_output_is_the_shipped_rules_file() -> None:
    code, out, err = command()
    assert (code, err) == (0, "")
    assert out == SHIPPED.read_text(), REGENERATE
    assert out == rules_file(RuleOptions())


def test_output_file(tmp_path: Path) -> None:
    target = tmp_path / "rules.yml"
    assert command("-o", str(target)) == (0, "", "")
    assert target.read_text() == SHIPPED.read_text()


def test_yaml_reads_back_every_rule_as_defined() -> None:
    defined = [rule for _, _, group in prometheus_rules.rules(RuleOptions()) for rule in group]
    read = loaded(rules_file(RuleOptions()))
    assert len(read) == len(defined)
    for rule, back in zip(defined, read, strict=True):
        if isinstance(rule, Record):
            assert back == {"record": rule.name, "expr": rule.expr}
        else:
            assert isinstance(rule, Alert)
            assert back == {"alert": rule.name, "expr": rule.expr, "for": rule.for_,
                            "labels": dict(rule.labels),
                            "annotations": dict(rule.annotations)}


def test_names_follow_the_convention_and_the_job_rules_keep_job_id() -> None:
    names = [rule["record"] for rule in loaded(SHIPPED.read_text()) if "record" in rule]
    assert len(names) == len(set(names))
    for name in names:
        level, metric, operations = name.split(":")
        assert metric.startswith("dlprof_") and not metric.endswith("_total"), name
        assert re.fullmatch(r"[a-z0-9_]+", operations), name
        if level.startswith("job_id"):
            # Aggregated to the job (and rank): no window in the name, so the
            # dashboard reads the same series whatever --rate-window is.
            assert not re.search(r"\d+[smh]$", operations), name
        else:
            assert level.startswith("instance"), name
    alerts = {rule["alert"]: rule for rule in loaded(SHIPPED.read_text()) if "alert" in rule}
    assert set(alerts) == {"DlprofStragglerRank", "DlprofSlowExchange", "DlprofJobStalled",
                           "DlprofMissingRanks", "DlprofAgentDown", "DlprofProbeDown"}
    straggler = alerts["DlprofStragglerRank"]
    assert "$labels.rank" in straggler["annotations"]["summary"]
    assert "$labels.cause" in straggler["annotations"]["summary"]
    assert all(rule["for"] == ("5s" if name in FAST_ALERTS else "2m")
               for name, rule in alerts.items())


def test_options_change_the_window_for_and_scrape_job_only() -> None:
    code, out, _ = command("--rate-window", "10s", "--for", "30s", "--scrape-job", "agents")
    assert code == 0
    shipped, changed = loaded(SHIPPED.read_text()), loaded(out)
    assert [r.get("record") or r.get("alert") for r in changed] == \
        [r.get("record") or r.get("alert") for r in shipped]
    for before, after in zip(shipped, changed, strict=True):
        if "alert" in after:
            assert after["for"] == ("5s" if after["alert"] in FAST_ALERTS else "30s")
        if "record" in after and after["record"].startswith("instance"):
            assert after == before  # the older dashboards' 1m rules keep 1m
        else:
            assert "[1m]" not in after["expr"], after
    exprs = "\n".join(rule["expr"] for rule in changed)
    assert "[10s]" in exprs
    assert 'up{job=~"agents"} == 0' in exprs
    assert "--rate-window 10s --for 30s --scrape-job 'agents'" in out.splitlines()[0]


def test_the_straggler_share_moves_the_straggler_bar_and_the_suspects_with_it() -> None:
    code, out, _ = command("--straggler-share", "0.05")
    assert code == 0
    rules = {rule.get("record") or rule.get("alert"): rule for rule in loaded(out)}
    assert "(0.05 * job_id:dlprof_step_duration_seconds:median)" in \
        rules["job_id_rank:dlprof_step_own_seconds:straggler_excess"]["expr"]
    # A straggler is a suspect of a slow exchange too: the suspects' bar is no higher.
    assert "(0.05 * job_id:dlprof_step_duration_seconds:median)" in \
        rules["DlprofSlowExchange"]["expr"]
    assert "--straggler-share 0.05" in out.splitlines()[0]
    shipped = {rule.get("record") or rule.get("alert"): rule
               for rule in loaded(SHIPPED.read_text())}
    assert "(0.2 * " in shipped["job_id_rank:dlprof_step_own_seconds:straggler_excess"]["expr"]
    assert "(0.1 * " in shipped["DlprofSlowExchange"]["expr"]


@pytest.mark.parametrize(("args", "message"), [
    (("--rate-window", "0s"), "argument --rate-window: 0s holds no samples"),
    (("--rate-window", "1 m"), "'1 m' is not a Prometheus duration"),
    (("--rate-window", "1.5m"), "'1.5m' is not a Prometheus duration"),
    (("--for", "2x"), "argument --for: '2x' is not a Prometheus duration"),
    (("--for", "m1"), "'m1' is not a Prometheus duration"),
    (("--scrape-job", "dlprof("), "'dlprof(' is not a regular expression"),
    (("--scrape-job", "dlprof(?!-test)"), "Prometheus's regular expressions (RE2) do not"),
    (("--straggler-share", "1.5"), "a straggler share of 1.5 is not a share of the step"),
    (("--straggler-share", "0"), "a straggler share of 0 is not a share of the step"),
])
def test_bad_values_are_one_line_errors(args: tuple[str, ...], message: str) -> None:
    code, out, err = command(*args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("dlprof-agent: error: "), err
    assert message in err


def test_an_output_that_cannot_be_written_is_an_error(tmp_path: Path) -> None:
    code, out, err = command("-o", str(tmp_path / "missing" / "rules.yml"))
    assert (code, out) == (2, "")
    assert err.startswith("dlprof-agent: error: cannot write ") and err.count("\n") == 1


def test_durations_are_read_as_prometheus_reads_them() -> None:
    assert prometheus_rules.duration_ms("1m") == 60_000
    assert prometheus_rules.duration_ms("1h30m") == 5_400_000
    assert prometheus_rules.duration_ms("1500ms") == 1500
    assert prometheus_rules.duration_ms("0") == 0
    for bad in ("", "1", "30m1h", "-1m", "1M"):
        with pytest.raises(ValueError, match="not a Prometheus duration"):
            prometheus_rules.duration_ms(bad)


def test_help_teaches_the_straggler_rule() -> None:
    code, out, _ = command("--help")
    assert code == 0
    flat = " ".join(out.split())
    assert "own time per step (step time less the time it waited in collectives)" in flat
    assert ("above its job's median by --straggler-share (20%) of the job's median step "
            "time, and 0.5 ms" in flat)
    assert "dlprof-agent rules --rate-window 10s --for 10s" in out


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`)")
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


def test_promtool_checks_the_output_with_other_options(tmp_path: Path) -> None:
    code, out, _ = command("--rate-window", "10s", "--for", "0s")
    assert code == 0
    (tmp_path / "rules.yml").write_text(out)
    result = promtool("check", "rules", "rules.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_runs_the_job_cases_on_the_command_output(tmp_path: Path) -> None:
    for cases_file in (PROMTOOL_CASES, PROMTOOL_SHORT_CASES):
        shutil.copy(cases_file, tmp_path / cases_file.name)
    assert command("-o", str(tmp_path / "rules.yml"))[0] == 0
    result = promtool("test", "rules", PROMTOOL_CASES.name, PROMTOOL_SHORT_CASES.name,
                      cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == 2, result.stdout
    # The cases cover every cause the rank's own signals name, and every alert.
    cases = PROMTOOL_CASES.read_text()
    for cause in prometheus_rules.CAUSES:
        assert f"cause: {cause}\n" in cases, cause
    for alert in ("DlprofStragglerRank", "DlprofJobStalled", "DlprofMissingRanks",
                  "DlprofAgentDown", "DlprofProbeDown", "DlprofSlowExchange"):
        assert f"alertname: {alert}\n" in cases, alert
