"""The `pagedserve serve` that `bench chaos` runs (or one it attaches to), and its scheduler's KV blocks.

The stack is a `pagedserve serve` child on free ports, with its runtime
directory (the internal sockets, the scheduler's control socket) and its log
in the bench's work directory. The KV blocks are read from the scheduler's
control service (GetStats): all free means nothing runs or waits and
`num_free_blocks == num_blocks - 1` (block 0 is reserved).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.process_supervisor import free_tcp_port

READY_LINE = "pagedserve is ready"


@dataclass
class ServeStack:
    base_url: str
    serve_pid: int
    control_address: str  # grpc target, e.g. unix:/run/dir/control
    process: subprocess.Popen | None = None  # None when attached to a running serve
    log_path: Path | None = None
    api_key: str | None = None  # sent on every request and control call

    @classmethod
    def start(cls, work_dir: Path, serve_args: list[str], ready_timeout: float,
              api_key: str | None = None) -> ServeStack:
        port, grpc_port = free_tcp_port(), free_tcp_port()
        runtime_dir = work_dir / "run"
        log_path = work_dir / "serve.log"
        command = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port), "--grpc-port",
                   str(grpc_port), "--runtime-dir", str(runtime_dir), *serve_args]
        env = {**os.environ, **({"PAGEDSERVE_API_KEY": api_key} if api_key else {})}  # not on a command line
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        stack = cls(f"http://127.0.0.1:{port}", process.pid, f"unix:{runtime_dir}/control", process, log_path,
                    api_key)
        try:
            stack._wait_ready(ready_timeout)
        except BaseException:
            stack.stop()
            raise
        return stack

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if READY_LINE in self.log_tail(1 << 30):
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.3)
        raise RuntimeError(f"pagedserve serve did not become ready (log {self.log_path}):\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM serve (it stops its components), then SIGKILL whatever of its session is left."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()


def scheduler_stats(control_address: str, api_key: str | None = None, timeout: float = 5.0) -> Any:
    """GetStats, with the API key as the bearer token (a service that needs none ignores it)."""
    import grpc

    from common.grpc_gen import control_pb2, control_pb2_grpc

    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with grpc.insecure_channel(control_address) as channel:
        return control_pb2_grpc.SchedulerControlStub(channel).GetStats(control_pb2.Empty(), timeout=timeout,
                                                                       metadata=metadata)


def kv_blocks_at_end(control_address: str, wait_s: float, api_key: str | None = None) -> dict[str, Any]:
    """The scheduler's blocks once all are free, or as they are after `wait_s` seconds (a scheduler
    that does not answer, e.g. one just restarted, is asked again until then)."""
    deadline = time.monotonic() + wait_s
    stats, error = None, None
    while True:
        try:
            stats, error = scheduler_stats(control_address, api_key), None
            if _all_free(stats):
                break
        except Exception as e:  # grpc.RpcError and friends: not up yet
            error = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if stats is None:
        return {"all_free": False, "error": error or "no answer"}
    return {"all_free": _all_free(stats), "num_free_blocks": stats.num_free_blocks, "num_blocks": stats.num_blocks,
            "usable_blocks": max(stats.num_blocks - 1, 0), "num_running": stats.num_running,
            "num_waiting": stats.num_waiting, **({"error": error} if error else {})}


def _all_free(stats: Any) -> bool:
    return (stats.num_running == 0 and stats.num_waiting == 0 and stats.num_blocks > 0
            and stats.num_free_blocks == stats.num_blocks - 1)  # block 0 is reserved
