"""The no-harm matrix (``benchmarks/no_harm.py``) on a few cheap kinds of job, each
injector path once: every attach (the last one as the job ends) and every kill of an
agent during its injection leaves the job's final weights and exit code those of an
untouched run. And its section of docs/reach.md is replaced in place, and kept when
``benchmarks/reach.py`` rewrites the file."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from benchmarks import no_harm, reach
from tests.helpers import NO_OWN_INJECTOR, OWN_INJECTOR


@pytest.mark.slow  # real jobs, attached to and killed into, for a minute each
@pytest.mark.skipif(not OWN_INJECTOR, reason=NO_OWN_INJECTOR)
@pytest.mark.parametrize(("kind", "injector"), [
    ("python", "default"),  # a busy main thread, met in the eval loop's own code
    ("pinned", "default"),  # a busy main thread, met in libtorch
    ("sleep", "gdb"),  # gdb needs a thread waiting in the kernel: the sleeping main
    ("compile", "default"),  # nothing recompiled, nothing warned, a compiled step timed
])
def test_attaches_and_kills_leave_the_job_computing_the_same(kind: str, injector: str) -> None:
    missing = no_harm.missing(kind)
    if missing:
        pytest.skip(missing)
    if injector == "gdb" and shutil.which("gdb") is None:
        pytest.skip("gdb is not installed")
    (row,) = no_harm.measure(kind, attaches=2, kills=3, injectors=(injector,), scale=0.3)
    assert not row.why_not, row.why_not
    assert len(row.attaches) == 2
    assert sum(run.kills for run in row.kill_runs) == 3
    assert not row.harms(), "\n".join(
        [*row.harms(), *(attach.outcome.stderr[-2000:] for attach in row.attaches)])


def test_the_attach_moments_spread_over_the_run_and_the_last_is_its_end() -> None:
    assert no_harm.moments(1000, 4) == [100, 500, 900, 1000]
    assert no_harm.moments(1000, 2) == [500, 1000]


def test_a_row_says_each_harm() -> None:
    same = no_harm.Outcome(0, ("ab" * 32,), 10.0, "")
    crashed = no_harm.Outcome(-11, ("ab" * 32,), 10.0, "Segmentation fault")
    row = no_harm.Row("pinned", "ptrace", same,
                      [no_harm.Attach(100, same, "probe active in pid 1"),
                       no_harm.Attach(1000, crashed, "")],
                      [no_harm.KillRun(3, [0.01, 0.02, 0.03], [], same)], 0.1)
    text = no_harm.section([row], 2, 3, 60.0, ("### On a test's CPU", ["CPU: a test's"]))
    assert ("| pinned single-thread torch loop | ptrace | 1/2 | 2/3 | 3/3 | untouched 10 s; "
            "probe up 1/2;") in text
    assert "attach at step 1000: exit -11, weights abababababab" in text
    assert "### On a test's CPU\n\nCPU: a test's\nEach row: 2 attaches, 3 kills." in text


def table(cpu: str, *rows: str, said: str = "what was done") -> str:
    return "\n".join([f"{no_harm.SECTION}", "", said, "", f"{no_harm.MACHINE_HEADING}{cpu}", "",
                      "| kind of job | injector | a | b | c | notes |", "|---|---|---|---|---|---|",
                      *rows, "", "took N minutes"]) + "\n"


def test_the_section_is_replaced_in_place_and_a_run_of_a_few_kinds_keeps_the_other_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pinned, python = no_harm.KINDS["pinned"].label, no_harm.KINDS["python"].label
    old = table("X, AVX-512, no AMX", f"| {pinned} | ptrace | 1/4 | old |",
                f"| {pinned} | gdb | 4/4 | old |", f"| {python} | ptrace | 4/4 | old |")
    new = table("X, AVX-512, no AMX", f"| {python} | ptrace | 3/4 | new |",
                f"| {pinned} | ptrace | 4/4 | new |", said="what was done now")
    text = f"# Reach\n\ntable\n\n{old}\n## In a Debian root: sid, Python 3.14\n\nrows\n"
    replaced = no_harm.with_section(text, new)
    assert replaced == text.replace(old, table(
        "X, AVX-512, no AMX", f"| {pinned} | ptrace | 4/4 | new |",
        f"| {pinned} | gdb | 4/4 | old |", f"| {python} | ptrace | 3/4 | new |",
        said="what was done now"))
    assert no_harm.with_section("# Reach\n", new) == f"# Reach\n\n{new}"

    other_cpu = table("Y, AVX2, no AVX-512", f"| {python} | ptrace | 2/4 | other |")
    both = no_harm.with_section(replaced, other_cpu)
    kept, added = both.split(f"{no_harm.MACHINE_HEADING}Y, AVX2")
    assert f"| {pinned} | gdb | 4/4 | old |" in kept and "3/4 | new" in kept
    assert f"| {python} | ptrace | 2/4 | other |" in added and "new" not in added
    assert "what was done now" not in both and both.count(no_harm.SECTION) == 1
    assert both.endswith("## In a Debian root: sid, Python 3.14\n\nrows\n")

    out = tmp_path / "reach.md"
    out.write_text(replaced)
    monkeypatch.setattr(reach, "measure", lambda kind, limit: reach.Row(kind, True, 0.1, 1))
    assert reach.main(["--out", str(out), "main in join()"]) == 0
    rewritten = out.read_text()
    assert "| main in join() | yes | 0.1 | 1 |  |" in rewritten
    assert "## In a Debian root: sid" in rewritten
    assert rewritten.endswith(no_harm.with_section(old, new))
    assert rewritten.count("## Notes") == 1


def test_the_instruction_sets_name_what_the_register_state_holds() -> None:
    said = no_harm.instruction_sets
    assert said({"avx2"}) == "AVX2, no AVX-512"
    assert said({"avx2", "avx512f", "avx512_fp16"}) == "AVX-512 with FP16, no AMX"
    assert (said({"avx512f", "avx512_bf16", "avx512_fp16", "amx_tile"})
            == "AMX and AVX-512 with BF16 and FP16")
    heading, described = no_harm.machine()
    assert heading.startswith(no_harm.MACHINE_HEADING) and described[0].startswith("CPU: ")
    # arm64's, from cpuinfo's Features: the widest vectors, then PAC and BTI
    arm64 = no_harm.arm64_features
    assert arm64({"fp", "asimd", "sve", "sve2", "paca", "pacg", "bti"}) == "SVE2, PAC, BTI"
    assert arm64({"sve", "sme", "sme2", "paca"}) == "SVE, SME2, PAC"
    assert arm64({"fp", "asimd"}) == "FP/SIMD only"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@pytest.mark.slow  # starts a PyTorch job
def test_a_kind_run_untouched_twice_computes_the_same(tmp_path: Path) -> None:
    first, second = no_harm.untouched("pinned", 200)
    assert first.exit_code == 0 and len(first.weights) == 1 and first.same_as(second)
