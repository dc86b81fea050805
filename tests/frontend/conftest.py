"""Fixtures for the frontend tests: a real frontend process (`python -m
frontend.frontend_cli`) and a real tokenizer pool process, both using a tiny byte-level
BPE tokenizer with a ChatML template, in front of a fake scheduler and a fake
control service running in the test process."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from logged_process import LoggedProcess
from tests.tokenizer_pool.tokenizer_pool_helpers import build_tiny_tokenizer as build_bpe_tokenizer

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256
SERVED_NAMES = ["tiny-model", "tiny-alias"]


def build_tiny_tokenizer(path: Path) -> Path:
    from tests.frontend.fakes import SCRIPT_TEXT

    corpus = [SCRIPT_TEXT, "Hello, world! How are you today?", "naïve café — 日本語 🙂", "Say hello to me."] * 20
    return build_bpe_tokenizer(path, corpus)


class Process(LoggedProcess):
    """`python -m MODULE ARGS`, logging at INFO."""

    def __init__(self, module: str, args: list[str], log_path: Path):
        super().__init__([sys.executable, "-m", module, *args], log_path, {"PAGEDSERVE_LOG_LEVEL": "INFO"},
                         name=module)


@dataclass
class Server:
    base_url: str  # http://127.0.0.1:PORT
    grpc_address: str
    tokenizer: object
    scheduler: "FakeScheduler"  # noqa: F821
    control: "FakeControl"  # noqa: F821
    frontend: Process
    eos_token_id: int
    slow_token: int
    reject_token: int
    frontend_args: list[str]  # to start another frontend in front of the same fakes

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"


def start_frontend(args: list[str], log_path: Path) -> tuple[Process, str, str]:
    """A frontend process; returns it, its base URL and its gRPC address once it is healthy."""
    frontend = Process("frontend.frontend_cli", args, log_path)
    try:
        match = frontend.wait_for_log(r"OpenAI API on (https?://[\d.]+:\d+)/v1, gRPC(?: \(TLS\))? on ([\d.]+:\d+)")
        wait_healthy(match.group(1) + "/health")
    except BaseException:
        frontend.stop()
        raise
    return frontend, match.group(1), match.group(2)


def wait_healthy(url: str, timeout: float = 30.0) -> None:
    from pagedserve.serve import health_ok

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health_ok(url):
            return
        time.sleep(0.1)
    raise AssertionError(f"{url} never became healthy")


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    from common.tokenizer import load_tokenizer
    from local_ports import free_port
    from tests.frontend.fakes import FakeControl, FakeScheduler

    tmp = tmp_path_factory.mktemp("frontend")
    tokenizer_dir = build_tiny_tokenizer(tmp / "tokenizer")
    tokenizer = load_tokenizer(str(tokenizer_dir))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    slow_token, reject_token = tokenizer.encode("`")[0], tokenizer.encode("~")[0]
    script = tokenizer.encode(" Hello, world! How are you today? The quick brown fox jumps over the lazy dog.")
    scheduler = FakeScheduler(f"tcp://127.0.0.1:{free_port()}", script, eos, max_model_len=MAX_MODEL_LEN,
                              slow_token=slow_token, slow_script=script, slow_interval=0.05,
                              reject_token=reject_token).start()
    control_address = f"127.0.0.1:{free_port()}"
    control = FakeControl(MAX_MODEL_LEN, len(tokenizer)).start(control_address)
    tokenizer_address = f"tcp://127.0.0.1:{free_port()}"
    pool = Process("tokenizer_pool.tokenizer_pool_cli", [
        "--model", str(tokenizer_dir), "--tokenizer-pool-size", "1", "--frontend-address", tokenizer_address,
        "--backend-address", f"tcp://127.0.0.1:{free_port()}"], tmp / "pool.log")
    frontend_args = [
        "--model", str(tokenizer_dir), "--served-model-name", *SERVED_NAMES, "--port", "0", "--grpc-port", "0",
        "--scheduler-address", scheduler.address, "--scheduler-control-address", control_address,
        "--tokenizer-address", tokenizer_address]
    frontend = None
    try:
        frontend, base_url, grpc_address = start_frontend(frontend_args, tmp / "frontend.log")
        yield Server(base_url, grpc_address, tokenizer, scheduler, control, frontend, eos, slow_token,
                     reject_token, frontend_args)
    finally:
        if frontend is not None:
            frontend.stop()
        pool.stop()
        control.stop()
        scheduler.stop()


@pytest.fixture(scope="session")
def tool_stacks(server, tmp_path_factory):
    """`tool_stacks(parser)`: a frontend running "auto" tool choice with that tool-call
    parser, in front of its own fake scheduler (`tool_stack.py`); started on first use."""
    from tests.frontend.tool_stack import start_tool_stack

    stacks = {}

    def stack_for(parser: str):
        if parser not in stacks:
            stacks[parser] = start_tool_stack(server, tmp_path_factory.mktemp(f"auto-tools-{parser}"), parser)
        return stacks[parser]

    try:
        yield stack_for
    finally:
        for stack in stacks.values():
            stack.stop()


@pytest.fixture(scope="session")
def tool_stack(tool_stacks):
    """The hermes stack."""
    return tool_stacks("hermes")
