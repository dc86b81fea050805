"""Run a real `pagedserve serve` (all four kinds of process, real sockets) and inspect its processes."""
from __future__ import annotations

import os
import re
import signal
import urllib.request
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from local_ports import free_port
from pagedserve.bench.chaos_victims import descendants, process_title as cmdline  # noqa: F401 (tests import them)
from logged_process import REPO, LoggedProcess  # noqa: F401 (tests import REPO from here)

MODEL = "smollm2-135m-instruct"


def _proc_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command name) of every live process."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                yield int(entry), f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue


def session_processes(session: int) -> list[int]:
    """Live (not zombie) processes of this session: what a command started with
    start_new_session left behind."""
    return [pid for pid, fields in _proc_stats() if int(fields[3]) == session and fields[0] != "Z"]


class Server(LoggedProcess):
    """`pagedserve serve` on free ports. `dtype`: float32 (the exact reference most
    tests compare with), or None for the default a user gets."""

    def __init__(self, tmp: Path, extra_args: list[str], *, dtype: str | None = "float32",
                 env: dict[str, str] | None = None):
        self.port, self.grpc_port = free_port(), free_port()
        self.runtime_dir = tmp / "run"
        dtype_args = [] if dtype is None else ["--dtype", dtype]
        super().__init__([sys.executable, "-m", "pagedserve.cli", "serve", *dtype_args, "--port", str(self.port),
                          "--grpc-port", str(self.grpc_port), "--runtime-dir", str(self.runtime_dir),
                          "--kv-cache-memory", "1GiB", *extra_args], tmp / "serve.log", env=env, name="serve")
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "pagedserve is ready" in self.log():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"serve did not become ready:\n{self.log()[-4000:]}")

    def component_pids(self) -> dict[str, list[int]]:
        """Descendant processes by title (`pagedserve: frontend`, ...)."""
        found: dict[str, list[int]] = {}
        for pid in descendants(self.proc.pid):
            match = re.match(r"pagedserve: (\w+)", cmdline(pid))
            if match:
                found.setdefault(match.group(1), []).append(pid)
        return found

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        return super().stop(sig, timeout)


@contextmanager
def running_server(tmp: Path, extra_args: list[str], **options) -> Iterator[Server]:
    """A ready `Server` (see its options), stopped however the block ends."""
    server = Server(tmp, extra_args, **options)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def metric_samples(server) -> dict[str, float]:
    """The server's /metrics, each sample name summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples
