"""`dlprof-agent trace`'s side of the protocol: progress while the window fills,
the records fetched in chunks, and each failure as one line with a hint."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from dlprof_agent.cli import trace as trace_cli
from dlprof_agent.errors import TraceUnavailable

PAYLOAD = {"steps": [1, 2, 3], "kernels": {}, "memcpy": {}, "layers": [],
           "names": ["x" * 50] * 20}


class Probe:
    """Answers like a probe's tracer: a window that fills, then its records."""

    def __init__(self, phases: list[dict[str, Any]], chunk: int = 100) -> None:
        self.phases = phases
        self.text = json.dumps(PAYLOAD)
        self.chunk = chunk
        self.requests: list[tuple[str, dict[str, Any]]] = []

    def request(self, command: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        self.requests.append((command, args or {}))
        if command == "trace":
            return {"ok": True, "layers": True}
        offset = (args or {}).get("offset", 0)
        if self.phases:
            return self.phases.pop(0)
        return {"ok": True, "phase": "done", "steps": 2, "wanted": 2, "size": len(self.text),
                "data": self.text[offset:offset + self.chunk]}


def run(probe: Probe, first: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    err = io.StringIO()
    payload = trace_cli.capture(probe, first, 2, 60, trace_cli._Progress(err, 42))  # type: ignore[arg-type]
    return payload, err.getvalue()


def test_progress_then_the_records_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_cli, "POLL_SECONDS", 0.0)
    probe = Probe([{"ok": True, "phase": "waiting", "steps": 0},
                   {"ok": True, "phase": "recording", "steps": 1},
                   {"ok": True, "phase": "collecting", "steps": 2}])
    payload, progress = run(probe)

    assert payload == PAYLOAD
    assert progress.splitlines()[:3] == [
        "dlprof-agent: tracing pid 42: waiting for the next step",
        "dlprof-agent: tracing pid 42: step 1 of 2",
        "dlprof-agent: tracing pid 42: 2 steps; collecting the GPU's records"]
    offsets = [args["offset"] for command, args in probe.requests if command == "trace_status"]
    assert offsets[-1] > 0 and offsets == sorted(offsets)


def test_beside_an_agent_the_first_reply_is_the_traces_own() -> None:
    probe = Probe([], chunk=10_000)
    payload, progress = run(probe, {"ok": True, "layers": False})
    assert payload == PAYLOAD
    assert [command for command, _ in probe.requests] == ["trace_status"]
    assert "no layer ranges: the attached agent runs without --layers" in progress


@pytest.mark.parametrize(("error", "hint"), [
    ("no GPU in use: the process has not started CUDA", "trace a job that trains on a GPU"),
    ("tracing busy: CUPTI is held by Nsight Systems", "stop the other profiler"),
    ("kernel tracing unavailable: cupti-python not installed in the job's environment "
     "(pip install cupti-python)", "pip install 'cupti-python==12.*'"),
    ("unknown command", "predates traces"),
])
def test_a_refusal_is_one_line_with_a_hint(error: str, hint: str) -> None:
    probe = Probe([])
    with pytest.raises(TraceUnavailable) as raised:
        run(probe, {"ok": False, "error": error})
    assert raised.value.message == error
    assert hint in raised.value.hint
    assert "\n" not in raised.value.one_line()
    assert raised.value.exit_code == 8


def test_a_window_that_fails_says_how_far_it_got(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_cli, "POLL_SECONDS", 0.0)
    probe = Probe([{"ok": False, "phase": "failed", "steps": 1,
                    "error": "only 1 of 2 steps before the time limit"}])
    with pytest.raises(TraceUnavailable) as raised:
        run(probe)
    assert raised.value.one_line() == (
        "only 1 of 2 steps before the time limit: ask for fewer --steps, or a longer --timeout")
