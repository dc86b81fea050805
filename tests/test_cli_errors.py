"""A bad flag, a bad PAGEDSERVE_* value or an address that cannot be used stops a
component with one clear line naming the problem, never a Python traceback."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from local_ports import free_port
from serve_helpers import session_processes

REPO = Path(__file__).resolve().parents[1]


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "pagedserve.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout + proc.stderr


def assert_clear_error(code: int, output: str, *fragments: str) -> None:
    assert code != 0, output
    assert "Traceback" not in output, output
    for fragment in fragments:
        assert fragment in output, output


def frontend_args(**ports: int) -> list[str]:
    """A frontend that would start (no scheduler needed), on free ports unless given."""
    return ["frontend", "--port", str(ports.get("port", free_port())),
            "--grpc-port", str(ports.get("grpc_port", free_port())),
            "--scheduler-address", f"tcp://127.0.0.1:{free_port()}",
            "--scheduler-control-address", f"127.0.0.1:{free_port()}",
            "--tokenizer-address", f"tcp://127.0.0.1:{free_port()}"]


def scheduler_args(**addresses: str) -> list[str]:
    return ["scheduler", "--scheduler-address", addresses.get("scheduler", f"tcp://127.0.0.1:{free_port()}"),
            "--worker-address", f"tcp://127.0.0.1:{free_port()}",
            "--scheduler-control-address", addresses.get("control", f"127.0.0.1:{free_port()}")]


@pytest.mark.parametrize("args, fragment", [
    (["frontend", "--port", "99999"], "--port"),
    (["frontend", "--grpc-port", "-1"], "--grpc-port"),
    (["frontend", "--request-timeout", "-1"], "--request-timeout"),
    (["serve", "--port", "70000"], "--port"),
    (["scheduler", "--frontend-timeout", "0"], "--frontend-timeout"),
    (["scheduler", "--max-waiting-requests", "-1"], "--max-waiting-requests"),
    (["scheduler", "--worker-step-timeout", "-5"], "--worker-step-timeout"),
    (["worker", "--handshake-timeout", "0"], "--handshake-timeout"),
])
def test_out_of_range_flags_are_usage_errors(args, fragment):
    code, output = run(args)
    assert code == 2
    assert_clear_error(code, output, fragment)


@pytest.mark.parametrize("command, variable, flag", [
    ("serve", "PAGEDSERVE_PORT", "--port"),
    ("frontend", "PAGEDSERVE_PORT", "--port"),
    ("frontend", "PAGEDSERVE_REQUEST_TIMEOUT", "--request-timeout"),
    ("scheduler", "PAGEDSERVE_MAX_NUM_SEQS", "--max-num-seqs"),
    ("scheduler", "PAGEDSERVE_MAX_WAITING_REQUESTS", "--max-waiting-requests"),
    ("worker", "PAGEDSERVE_BLOCK_SIZE", "--block-size"),
])
def test_bad_environment_values_are_usage_errors(command, variable, flag):
    code, output = run([command], env={variable: "lots"})
    assert code == 2
    assert_clear_error(code, output, flag, "lots", f"(from {variable} in the environment)")
    assert len(output.strip().splitlines()) == 1, output  # no usage: the command line was fine


def test_frontend_http_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, output = run(frontend_args(port=taken.getsockname()[1]))
    assert_clear_error(code, output, "in use")


def test_frontend_grpc_port_in_use():
    other = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        code, output = run(frontend_args(grpc_port=port))
    finally:
        other.stop(grace=None).wait()
    assert_clear_error(code, output, "in use", str(port))


def test_frontend_bad_host_and_addresses():
    assert_clear_error(*run(frontend_args() + ["--host", "no-such-host.invalid"]), "no-such-host.invalid")
    assert_clear_error(*run(frontend_args() + ["--scheduler-address", "bogus"]), "bogus")


def test_scheduler_addresses_in_use_or_invalid():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        assert_clear_error(*run(scheduler_args(scheduler=address)), "in use", address)
    assert_clear_error(*run(scheduler_args(scheduler="bogus")), "bogus")
    assert_clear_error(*run(scheduler_args(control="bogus:zz")), "bogus:zz")


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_serve_refuses_a_port_in_use_instead_of_reporting_another_server_ready(tmp_path, flag):
    # Before: the frontend crashed in a loop while serve probed the other server's
    # /health and printed "pagedserve is ready".
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--port": str(free_port()), "--grpc-port": str(free_port()), flag: str(port)}
        code, output = run(["serve", "--runtime-dir", str(tmp_path / "run"), "--ready-timeout", "20",
                            *[item for pair in ports.items() for item in pair]], timeout=60)
    assert_clear_error(code, output, "in use", str(port))
    assert "is ready" not in output and "started" not in output


def test_serve_checks_the_tool_settings_its_frontend_inherits():
    """The frontend inherits PAGEDSERVE_ENABLE_AUTO_TOOL_CHOICE / _TOOL_CALL_PARSER:
    serve reads and checks them once, instead of a frontend restart loop."""
    code, output = run(["serve"], env={"PAGEDSERVE_ENABLE_AUTO_TOOL_CHOICE": "1"}, timeout=30)
    assert_clear_error(code, output, "--enable-auto-tool-choice needs --tool-call-parser")
    code, output = run(["serve"], env={"PAGEDSERVE_TOOL_CALL_PARSER": "bogus"}, timeout=30)
    assert_clear_error(code, output, "--tool-call-parser", "bogus")


def test_the_frontend_refuses_an_unknown_tool_call_parser_from_the_environment():
    code, output = run(frontend_args(), env={"PAGEDSERVE_TOOL_CALL_PARSER": "bogus"}, timeout=30)
    assert_clear_error(code, output, "--tool-call-parser", "bogus")


def test_serve_stops_at_once_on_a_bad_setting_a_component_inherits(tmp_path):
    """Before: the frontend read PAGEDSERVE_REQUEST_TIMEOUT, exited with a usage
    error at each restart, and serve never became ready."""
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "serve", "--runtime-dir", str(tmp_path / "run"),
                             "--port", str(free_port()), "--grpc-port", str(free_port())],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PAGEDSERVE_REQUEST_TIMEOUT": "abc"}, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 2, output
    assert_clear_error(proc.returncode, output, "frontend", "--request-timeout", "PAGEDSERVE_REQUEST_TIMEOUT", "'abc'")
    assert len(output.strip().splitlines()) == 1, output
    assert session_processes(proc.pid) == []


def test_a_worker_whose_kv_cache_holds_no_block_exits_with_a_usage_error(tmp_path):
    """Exit status 2, which serve does not restart: the same settings would fail the same way."""
    code, output = run(["worker", "--dtype", "float32", "--kv-cache-memory", "1KiB",
                        "--worker-address", f"ipc://{tmp_path}/worker"], timeout=120)
    assert code == 2, output
    assert_clear_error(code, output, "cannot start the worker", "kv_cache_memory", "KV cache blocks")
