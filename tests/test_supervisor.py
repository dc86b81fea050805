"""The supervisor with small stand-in processes (no model): a usage error (exit
status 2) is not restarted, other failures are, and each line about an exit
says why the component went (its last line), instead of leaving the reason
somewhere among the other components' logs."""
from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_ports import free_port
from serve_helpers import session_processes

from common.errors import USAGE_ERROR
from pagedserve.process_supervisor import Component, Supervisor

REPO = Path(__file__).resolve().parents[1]


class Script(Component):
    """A component that runs a line of Python instead of `pagedserve ...`."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", *self.argv]


def fails(message: str, code: int) -> Script:
    return Script("frontend", [f"import sys; print('starting', file=sys.stderr); "
                               f"print({message!r}, file=sys.stderr); sys.exit({code})"])


def poll_until(supervisor: Supervisor, done, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        supervisor.poll()
        time.sleep(0.05)
    assert done(), "timed out"


@pytest.fixture
def supervised():
    started: list[Supervisor] = []

    def start(*components: Component) -> Supervisor:
        supervisor = Supervisor(list(components))
        started.append(supervisor)
        supervisor.start_all()
        return supervisor

    yield start
    for supervisor in started:
        supervisor.stop_all()


def test_a_usage_error_stops_the_supervisor_with_the_reason(supervised, caplog, capfd, monkeypatch):
    sleeper = Script("scheduler", ["import time; time.sleep(60)"])
    supervisor = supervised(fails("pagedserve frontend: error: argument --port: bad", USAGE_ERROR), sleeper)
    with caplog.at_level(logging.INFO, logger="pagedserve.supervisor"):
        poll_until(supervisor, lambda: supervisor.stopping)
        assert supervisor.components[0].restart_at is None  # no restart scheduled
        far_future = time.monotonic() + 3600  # past any backoff, without waiting for it
        with monkeypatch.context() as m:
            m.setattr(time, "monotonic", lambda: far_future)
            supervisor.poll()
    assert supervisor.exit_code == USAGE_ERROR
    assert supervisor.components[0].restarts == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "exited with code 2: pagedserve frontend: error: argument --port: bad" in errors[0]
    assert "not restarting" in errors[0]
    assert "starting" in capfd.readouterr().err  # its output still reaches ours
    supervisor.stop_all()
    assert sleeper.process.poll() is not None


def test_another_failure_is_restarted_with_backoff_and_its_reason(supervised, caplog):
    supervisor = supervised(fails("RuntimeError: boom", 1))
    with caplog.at_level(logging.WARNING, logger="pagedserve.supervisor"):
        poll_until(supervisor, lambda: supervisor.components[0].restarts >= 1)
    assert not supervisor.stopping and supervisor.exit_code == 0
    exits = [r.getMessage() for r in caplog.records if "exited" in r.getMessage()]
    assert re.fullmatch(r"frontend \(pid \d+\) exited with code 1: RuntimeError: boom; restarting in 1s", exits[0])
    assert supervisor.components[0].backoff_s == 2.0


def test_a_killed_component_gets_no_last_words(supervised, caplog):
    supervisor = supervised(Script("worker", ["import sys, time; print('loading', file=sys.stderr); "
                                              "sys.stderr.flush(); time.sleep(60)"]))
    worker = supervisor.components[0]
    # It must have said something before the kill, or "no last words" proves nothing.
    poll_until(supervisor, lambda: worker.relay.last_line() == "loading")
    worker.process.kill()
    with caplog.at_level(logging.WARNING, logger="pagedserve.supervisor"):
        poll_until(supervisor, lambda: worker.restart_at is not None)
    message = caplog.records[-1].getMessage()
    assert "was killed by SIGKILL; restarting" in message and "loading" not in message


def test_serve_gives_up_when_a_component_exits_with_a_usage_error(tmp_path):
    """A frontend that stops with a usage error at start (here: a generation
    config that passed serve's check but cannot be read) used to be restarted
    forever; serve now stops everything and exits 2, its last line the reason."""
    (tmp_path / "generation_config.json").write_text("{not json")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "serve", "--runtime-dir", str(tmp_path / "run"),
                             "--port", str(free_port()), "--grpc-port", str(free_port()), "--dtype", "float32",
                             "--kv-cache-memory", "256MiB", "--generation-config", str(tmp_path)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 2, output[-3000:]
    reason = re.search(r"ERROR \[serve\] pagedserve.supervisor: frontend \(pid \d+\) exited with code 2: (.*)", output)
    assert reason and "generation_config.json" in reason.group(1), output[-3000:]
    assert "restarting frontend" not in output
    assert session_processes(proc.pid) == []
