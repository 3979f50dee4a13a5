"""`dlprof-agent top` in a real terminal: tmux runs it against a real training job
(and `top --url` against a real daemon watching two jobs), and its screen is read
back with capture-pane, as a person would see it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlprof_agent.collectors.limits import LimitsCollector
from dlprof_agent.collectors.target import Target
from tests.conftest import OWN_JOBS, REPO, agent_env, free_port, http_get, wait_for

pytestmark = pytest.mark.slow  # real jobs, real agents, a terminal

TMUX = shutil.which("tmux")
AGENT = [sys.executable, "-m", "dlprof_agent"]
# The probe's injection and an 8-thread job's first steps, beside CI's other workers
# on 2 cores: a generous bound (it draws in about 15 s; the misses once blamed on load
# were xdist's COLUMNS and LINES, see Terminal).
SCREEN_SECONDS = 180
WIDE, TALL = 140, 45


class Terminal:
    """A tmux server of the test's own (its own socket), one window."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        if TMUX is None:
            pytest.skip("tmux is not installed (scripts/setup installs it)")
        self.socket = f"dlprof-test-{uuid.uuid4().hex[:8]}"
        shell = " ".join(map(_quote, command)) + "; echo top-exited-$?; sleep 600"
        # xdist's workers export COLUMNS=80 and LINES=24, which a terminal program
        # takes over the size its terminal reports: top would draw 80 x 24 in 140 x 45.
        env = {name: value for name, value in env.items() if name not in ("COLUMNS", "LINES")}
        self._tmux("new-session", "-d", "-s", "top", "-x", str(WIDE), "-y", str(TALL),
                   shell, env=env)

    def _tmux(self, *args: str, env: dict[str, str] | None = None) -> str:
        assert TMUX is not None
        return subprocess.run([TMUX, "-L", self.socket, *args], env=env, cwd=REPO,
                              capture_output=True, text=True, check=True, timeout=30).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "top")

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "top", *keys)

    def resize(self, columns: int, lines: int) -> None:
        self._tmux("resize-window", "-t", "top", "-x", str(columns), "-y", str(lines))

    def wait_showing(self, *words: str, what: str, timeout: float = 30.0) -> str:
        """The screen once it shows every one of ``words``; on a timeout the error
        holds the last screen, which says what top was waiting for."""
        last = [""]

        def shows() -> str | None:
            last[0] = screen = self.screen()
            return screen if all(word in screen for word in words) else None

        try:
            found: str = wait_for(shows, what, timeout)
        except AssertionError as error:
            raise AssertionError(f"{error}\nthe last screen:\n{last[0]}") from None
        return found

    def close(self) -> None:
        subprocess.run([TMUX or "tmux", "-L", self.socket, "kill-server"],
                       capture_output=True, timeout=30, check=False)


def _quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


@pytest.fixture
def terminals() -> Iterator[list[Terminal]]:
    opened: list[Terminal] = []
    yield opened
    for terminal in opened:
        terminal.close()


def training_job(threads: int) -> list[str]:
    return [*AGENT, "workload", "run", "--model", "small-cnn", "--iterations", "1000000",
            "--warmup", "3", "--no-progress", "--threads", str(threads)]


def drawn_within(screen: str, columns: int) -> bool:
    """Every panel's borders close within ``columns``: the layout is whole."""
    lines = [line.rstrip() for line in screen.splitlines() if line.strip()]
    return bool(lines) and all(len(line) <= columns for line in lines) and all(
        line.endswith(("╮", "│", "╯")) for line in lines if line.startswith(("╭", "│", "╰")))


def test_top_shows_the_step_split_layers_and_a_finding_quits_with_the_summary_and_redraws(
        terminals: list[Terminal], processes: list[subprocess.Popen[bytes]]) -> None:
    pytest.importorskip("torch")
    allowed = LimitsCollector(Target.of(os.getpid())).sample().allowed_cpus
    # 8 threads on at most 4 CPUs: thread_oversubscription (tests/test_findings_e2e.py).
    oversubscribed = allowed is not None and allowed <= 4
    job = subprocess.Popen(training_job(8), cwd=REPO, env=agent_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    processes.append(job)
    terminal = Terminal([*AGENT, "top", str(job.pid), "--layers", "--layers-every", "1",
                         "--port", "0", "--interval", "0.5", "--no-kernels"], agent_env())
    terminals.append(terminal)

    def shows(*words: str) -> str | None:
        screen = terminal.screen()
        return screen if all(word in screen for word in words) else None

    screen = terminal.wait_showing("steps/s", "forward", "backward", "Conv2d",
                                   what="steps/s, the split and layer names on the screen",
                                   timeout=SCREEN_SECONDS)
    assert f"pid {job.pid}" in screen and "layers (" in screen
    if oversubscribed:
        terminal.wait_showing("thread_oversubscription", "try:",
                              what="the oversubscription finding, with what to try",
                              timeout=SCREEN_SECONDS)

    terminal.keys("l")  # layer timing off in the job, then on again
    terminal.wait_showing("layer timing is off", what="the layers panel saying timing is off")
    terminal.keys("l")
    terminal.wait_showing("layer timing on from the next pass", "Conv2d",
                          what="layer names back once timing is on again")
    terminal.keys("s")
    terminal.wait_showing("sorted by name", what="the tables sorted by name")
    terminal.keys("?")
    terminal.wait_showing("layer timing on or off", what="the help")
    terminal.keys("?")
    terminal.resize(70, 30)
    wait_for(lambda: (screen := shows("steps/s", "forward")) and drawn_within(screen, 70),
             "the screen redrawn whole at 70 columns")
    terminal.resize(WIDE, TALL)
    wait_for(lambda: (screen := shows("steps/s", "cpu and memory")) and drawn_within(
        screen, WIDE), "the screen redrawn whole at full width")

    terminal.keys("q")
    screen = terminal.wait_showing("top-exited-0", what="top's exit")
    assert f"dlprof-agent summary for pid {job.pid}" in screen
    assert "step split" in screen and "top layers" in screen
    assert job.poll() is None  # the job trains on after top has gone


def test_top_url_opens_a_daemons_targets_table_and_one_job_on_enter(
        terminals: list[Terminal], processes: list[subprocess.Popen[bytes]],
        tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {**agent_env(), "DLPROF_AGENT_RUNTIME_DIR": str(runtime)}
    jobs = [subprocess.Popen([sys.executable, "-m", "dlprof_agent.workloads.busy",
                              "--threads", "1", "--seconds", "600"], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL) for _ in range(2)]
    processes.extend(jobs)
    port = free_port()
    daemon = subprocess.Popen(
        [*AGENT, "daemon", "--port", str(port), "--interval", "0.5", "--scan-interval",
         "0.5", "--match", r"dlprof_agent\.workloads\.busy", "--no-probe", "--no-gpu",
         *OWN_JOBS], cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    processes.append(daemon)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: all(f'dlprof_target_up{{pid="{job.pid}"}} 1.0' in
                         http_get(f"{url}/metrics").decode() for job in jobs),
             "both jobs among the daemon's targets")

    printed = subprocess.run([*AGENT, "top", "--url", url], env=agent_env(),
                             capture_output=True, text=True, timeout=60, check=False)
    assert printed.returncode == 0, printed.stderr
    assert all(str(job.pid) in printed.stdout for job in jobs), printed.stdout

    terminal = Terminal([*AGENT, "top", "--url", url, "--interval", "0.5"], agent_env())
    terminals.append(terminal)
    wait_for(lambda: "2 targets" in terminal.screen(), "the targets table")
    chosen = sorted(job.pid for job in jobs)[1]
    terminal.keys("Down", "Enter")  # one write: top reads both keys at once
    screen = terminal.wait_showing(f"pid {chosen}", "cpu and memory",
                                   what="the chosen job's screen")
    assert "no probe in this process" in screen  # the daemon was told --no-probe
    terminal.keys("q")
    wait_for(lambda: "top-exited-0" in terminal.screen(), "top's exit")


def test_top_url_honours_the_agents_tls_and_basic_auth_and_says_why_it_is_refused(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    web = pytest.importorskip("tests.test_web_config")  # bcrypt; openssl for the certificate
    config = web.write_config(tmp_path, tls=True, users=True)
    sleeper = subprocess.Popen(["sleep", "600"])
    processes.append(sleeper)
    port = free_port()
    processes.append(web.start_agent(sleeper.pid, config, port))
    url = f"https://127.0.0.1:{port}"

    def top(*args: str, password: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {**agent_env(), **({"DLPROF_PASSWORD": password} if password else {})}
        return subprocess.run([*AGENT, "top", "--url", url, "--interval", "0.5", *args],
                              env=env, capture_output=True, text=True, timeout=60,
                              check=False)

    untrusted = wait_for(lambda: (done := top()) and "not trusted" in done.stderr and done,
                         "the agent serving TLS")
    assert untrusted.returncode == 3 and untrusted.stderr.count("\n") == 1
    assert "--ca-file" in untrusted.stderr
    refused = top("--ca-file", str(tmp_path / "agent.crt"))
    assert refused.returncode == 3 and "HTTP 401" in refused.stderr
    assert refused.stderr.count("\n") == 1 and "--user" in refused.stderr
    wrong = top("--ca-file", str(tmp_path / "agent.crt"), "--user", "prometheus",
                password="not it")
    assert wrong.returncode == 3 and "HTTP 401" in wrong.stderr
    shown = top("--ca-file", str(tmp_path / "agent.crt"), "--user", "prometheus",
                password=web.PASSWORD)
    assert shown.returncode == 0, shown.stderr
    assert f"pid {sleeper.pid}" in shown.stdout and "cpu and memory" in shown.stdout


def test_off_a_terminal_top_says_so_and_behaves_as_attach(
        processes: list[subprocess.Popen[bytes]]) -> None:
    sleeper = subprocess.Popen(["sleep", "600"])
    processes.append(sleeper)
    done = subprocess.run([*AGENT, "top", str(sleeper.pid), "--duration", "1.5",
                           "--interval", "0.5", "--no-probe", "--no-serve"],
                          env=agent_env(), capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "top: not a terminal; behaving as attach" in done.stderr
    assert "not serving /metrics (--no-serve)" in done.stderr
    assert f"dlprof-agent summary for pid {sleeper.pid}" in done.stdout
