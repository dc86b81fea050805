"""Each component starts alone from its own CLI with addresses given by flags
(as ops and compose run them), and together they serve a request."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import openai

from local_ports import free_port
from serve_helpers import MODEL, REPO


def start(name: str, args: list[str], log_dir) -> tuple[subprocess.Popen, object]:
    log = open(log_dir / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", name, *args], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def test_components_started_one_by_one_over_tcp(tmp_path):
    scheduler, worker = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    tokenizer, backend = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    control, http_port, grpc_port = f"127.0.0.1:{free_port()}", free_port(), free_port()
    engine = ["--model", MODEL, "--dtype", "float32", "--kv-cache-memory", "512MiB"]
    procs = [
        # The worker first: it must wait for a scheduler that is not there yet.
        start("worker", [*engine, "--worker-address", worker], tmp_path),
        start("scheduler", [*engine, "--scheduler-address", scheduler, "--worker-address", worker,
                            "--scheduler-control-address", control], tmp_path),
        start("tokenizer", ["--model", MODEL, "--tokenizer-pool-size", "1", "--frontend-address", tokenizer,
                            "--backend-address", backend], tmp_path),
        start("frontend", ["--model", MODEL, "--port", str(http_port), "--grpc-port", str(grpc_port),
                           "--scheduler-address", scheduler, "--scheduler-control-address", control,
                           "--tokenizer-address", tokenizer], tmp_path),
    ]
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            dead = [p.args for p, _ in procs if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, (dead, {
                f.name: open(f.name, errors="replace").read()[-2000:] for _, f in procs})
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=32)
        assert "Paris" in reply.choices[0].message.content
    finally:
        for proc, log in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, log in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
