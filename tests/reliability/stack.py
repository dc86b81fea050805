"""A real frontend, tokenizer pool and scheduler around a model-free worker,
each its own process on TCP loopback, for reliability tests that do not
need a model: they start in seconds and generate as fast as a test needs.

The tokenizer is tests/frontend's tiny BPE tokenizer with a ChatML template;
the fake worker emits a scripted cycle of token ids and never EOS.
"""
from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import grpc

from common.grpc_gen import control_pb2, control_pb2_grpc
from local_ports import free_port
from tests.frontend.conftest import Process, build_tiny_tokenizer

MODEL_NAME = "tiny-model"
MAX_MODEL_LEN = 256
NUM_BLOCKS = 64
SCRIPT_TEXT = " one two three four five six seven eight nine ten"


class Stack:
    def __init__(self, tmp: Path, *, frontend_args: list[str] = (), scheduler_args: list[str] = (),
                 step_delay: float = 0.0, poison_text: str | None = None, hang_text: str | None = None,
                 worker_args: list[str] = ()):
        from common.tokenizer import load_tokenizer

        self.tmp = tmp
        self.tokenizer_dir = build_tiny_tokenizer(tmp / "tokenizer")
        self.tokenizer = load_tokenizer(str(self.tokenizer_dir))
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.script = self.tokenizer.encode(SCRIPT_TEXT)
        self.step_delay = step_delay
        # Workers die (or hang for a while) on a request whose prompt holds this text's first token.
        self.worker_args = list(worker_args)
        for flag, text in (("--crash-on-token", poison_text), ("--hang-on-token", hang_text)):
            if text:
                self.worker_args += [flag, str(self.tokenizer.encode(text)[0])]
        self.scheduler_address = f"tcp://127.0.0.1:{free_port()}"
        self.worker_address = f"tcp://127.0.0.1:{free_port()}"
        self.control_address = f"127.0.0.1:{free_port()}"
        tokenizer_address = f"tcp://127.0.0.1:{free_port()}"
        self.pool = Process("tokenizer_pool.tokenizer_pool_cli", [
            "--model", str(self.tokenizer_dir), "--tokenizer-pool-size", "1", "--frontend-address", tokenizer_address,
            "--backend-address", f"tcp://127.0.0.1:{free_port()}"], tmp / "pool.log")
        self.scheduler = Process("pagedserve.cli", [
            "scheduler", "--model", MODEL_NAME, "--device", "cpu", "--scheduler-address", self.scheduler_address,
            "--worker-address", self.worker_address, "--scheduler-control-address", self.control_address,
            "--disable-log-stats", *scheduler_args], tmp / "scheduler.log")
        self.workers = [self.start_worker()]
        self.frontend_args = ["--model", str(self.tokenizer_dir), "--served-model-name", MODEL_NAME,
                              "--scheduler-address", self.scheduler_address,
                              "--scheduler-control-address", self.control_address,
                              "--tokenizer-address", tokenizer_address, *frontend_args]
        self.frontend = self.start_frontend("frontend")
        self.base_url, self.grpc_address = self.frontend_urls(self.frontend)
        self.control = control_pb2_grpc.SchedulerControlStub(grpc.insecure_channel(self.control_address))

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def start_worker(self) -> Process:
        index = len(getattr(self, "workers", []))
        return Process("tests.reliability.fake_worker_main", [
            "--worker-address", self.worker_address, "--model", MODEL_NAME, "--num-blocks", str(NUM_BLOCKS),
            "--max-model-len", str(MAX_MODEL_LEN), "--vocab-size", str(len(self.tokenizer)), "--eos", str(self.eos),
            "--script", ",".join(map(str, self.script)), "--step-delay", str(self.step_delay), *self.worker_args],
            self.tmp / f"worker{index}.log")

    def start_frontend(self, name: str, extra_args: list[str] = ()) -> Process:
        return Process("frontend.frontend_cli", [*self.frontend_args, "--port", "0", "--grpc-port", "0", *extra_args],
                       self.tmp / f"{name}.log")

    @staticmethod
    def frontend_urls(frontend: Process) -> tuple[str, str]:
        match = frontend.wait_for_log(r"OpenAI API on (http://[\d.]+:\d+)/v1, gRPC on ([\d.]+:\d+)", timeout=120)
        return match.group(1), match.group(2)

    def wait_healthy(self, base_url: str | None = None, timeout: float = 60.0) -> None:
        wait_healthy(base_url or self.base_url, timeout)

    def expected_text(self, num_tokens: int) -> str:
        """What the fake worker generates for any request of `num_tokens` outputs."""
        cycle = (self.script * (num_tokens // len(self.script) + 1))[:num_tokens]
        return self.tokenizer.decode(cycle)

    def stats(self) -> control_pb2.SchedulerStats:
        return self.control.GetStats(control_pb2.Empty(), timeout=5)

    def wait_all_blocks_free(self, timeout: float = 60.0) -> control_pb2.SchedulerStats:
        return wait_all_blocks_free(self.stats, timeout)

    def logs(self) -> str:
        procs = [self.pool, self.scheduler, *self.workers, self.frontend]
        return "\n".join(f"--- {p.log_path.name}\n{p.log()[-3000:]}" for p in procs)

    def stop(self) -> None:
        for process in (self.frontend, *self.workers, self.scheduler, self.pool):
            process.stop()


def wait_healthy(base_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{base_url} never became healthy")


def wait_all_blocks_free(get_stats, timeout: float = 60.0) -> control_pb2.SchedulerStats:
    """Poll the scheduler until nothing runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        stats = get_stats()
        if (stats.num_running == 0 and stats.num_waiting == 0 and stats.num_blocks > 0
                and stats.num_free_blocks == stats.num_blocks - 1):  # block 0 is reserved
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks still held after {timeout}s: {stats}")
        time.sleep(0.05)


def log_lines(text: str, pattern: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(pattern, line)]

