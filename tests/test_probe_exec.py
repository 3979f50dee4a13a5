"""After exec the pid runs another program: the agent says so even when the old
probe's last reply is read after the exec, and takes a new command line for a
rename only when the probe answered a request sent after it was read."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from dlprof_agent.collectors.target import ProgramIdentity, Target
from dlprof_agent.probe_link import channel
from dlprof_agent.probe_link.channel import ProbeSource
from dlprof_agent.probe_link.samples import ProbeSample
from tests.test_probe_deadlines import probe_sample

OLD = ProgramIdentity(100, "/usr/bin/python3", "python3 train.py")
NEW = ProgramIdentity(100, "/usr/bin/python3", "python3 -c import time")


class Probe:
    """A client whose replies say what the pass asked: ``fresh`` replies answer a
    request sent in that call; others are held or late ones (no request answered)."""

    pid = 4242
    closed = stopped = False

    def __init__(self) -> None:
        self.hello: dict[str, object] = {}
        self.requests_sent = self.replies_taken = 0
        self.then: list[str] = []  # per call: "fresh", "stale", "closed"
        # What the process does once it has replied.
        self.after_reply: Callable[[], object] = lambda: None

    def set_timeout(self, seconds: float) -> None:
        pass

    def snapshot(self) -> ProbeSample:
        what = self.then.pop(0)
        if what == "closed":
            raise ConnectionResetError("the probe's socket closed")
        if what == "fresh":
            self.requests_sent += 1
            self.replies_taken += 1
        self.after_reply()
        return probe_sample(self.pid, 5)

    def close(self) -> None:
        self.closed = True

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def running(monkeypatch: pytest.MonkeyPatch) -> list[ProgramIdentity]:
    """What the process runs, as the agent reads it: the test changes it."""
    now = [OLD]
    monkeypatch.setattr(channel, "program_identity", lambda pid, procfs: now[0])
    return now


def source_on(probe: Probe) -> ProbeSource:
    return ProbeSource(probe, interval=1.0, target=Target(4242, 0), identity=OLD,  # type: ignore[arg-type]
                       clock=lambda: 0.0)


def test_an_exec_just_after_a_reply_is_said_once_the_socket_closes(
        running: list[ProgramIdentity], caplog: pytest.LogCaptureFixture) -> None:
    probe = Probe()
    source = source_on(probe)
    probe.then = ["fresh", "closed"]
    probe.after_reply = lambda: running.__setitem__(0, NEW)  # exec'd as the reply was read
    with caplog.at_level(logging.WARNING, logger="dlprof_agent"):
        assert source.sample() is not None
        assert source.sample() is None
    assert "now runs another program (exec): `python3 -c import time`" in caplog.text
    assert source.client is None and probe.closed


def test_a_new_command_line_the_probe_answered_after_is_a_rename(
        running: list[ProgramIdentity], caplog: pytest.LogCaptureFixture) -> None:
    probe = Probe()
    source = source_on(probe)
    running[0] = NEW  # setproctitle: the probe lives on
    probe.then = ["stale", "fresh", "closed"]
    with caplog.at_level(logging.WARNING, logger="dlprof_agent"):
        assert source.sample() is not None  # a held or late reply: cannot tell yet
        assert source._identity == OLD
        assert source.sample() is not None  # answered a request sent after it: a rename
        assert source._identity == NEW
        assert source.sample() is None  # then the job ends: no exec to say
    assert "another program" not in caplog.text
