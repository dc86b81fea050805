"""A child process in its own session with its output in a log file: what the tests start."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the repository: tests/ is its child


class LoggedProcess:
    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None, name: str | None = None):
        self.log_path, self.name = log_path, name or " ".join(argv[:4])
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout: float = 60.0) -> re.Match:
        """The first match of `pattern` in the log; AssertionError with the log's tail if the process
        exits or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log())
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not in the log of {self.name} (exit code {self.proc.poll()}):\n"
                             f"{self.log()[-3000:]}")

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal it, wait up to `timeout` s, then kill its whole session; its exit code."""
        if self.proc.poll() is None:
            self.terminate(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
