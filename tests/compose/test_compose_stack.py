"""The compose stack for real (`make compose-test`): compose.yaml's services built from the
Dockerfile, started, scaled, crashed and restarted one at a time, secured and taken down, all
through the published port with the openai client. Runs only with `-m compose`, after
scripts/docker/compose_test.sh has built pagedserve:latest; the checks run in file order on one
stack.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from compose_stack import REPORT, Stack, run
from local_ports import free_port
from polling import wait_for

pytestmark = pytest.mark.compose

HEALTHY_TIMEOUT = 900.0  # the worker's first start compiles its kernels (minutes on two cores)
PROMPTS = [f"Write one sentence about the number {i}:" for i in range(16)]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def report():
    return REPORT.append


@pytest.fixture(scope="module")
def stack(report):
    port, grpc_port = free_port(), free_port()
    stack = Stack({"PAGEDSERVE_PORT": str(port), "PAGEDSERVE_GRPC_PORT": str(grpc_port),
                   "PAGEDSERVE_DTYPE": "float32", "PAGEDSERVE_API_KEY": ""})
    stack.port = port
    stack("down", "-v", check=False)  # what a failed earlier run may have left
    start = time.monotonic()
    stack("up", "-d")
    try:
        elapsed = stack.wait_healthy(HEALTHY_TIMEOUT)
        report(f"from `up` to every service healthy: {time.monotonic() - start:.0f} s (healthy checks {elapsed:.0f} s)")
        yield stack
    finally:
        stack("down", "-v", check=False)


def client(stack, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key=api_key, max_retries=0,
                         timeout=300)


def stream_completion(api: openai.OpenAI, prompt: str, started: threading.Event | None = None) -> tuple[str, str]:
    """A greedy streamed completion's text and finish reason; sets `started` at its first token."""
    text, finish = [], None
    for chunk in api.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0, stream=True):
        choice = chunk.choices[0]
        text.append(choice.text)
        finish = choice.finish_reason or finish
        if started is not None and choice.text:
            started.set()
    return "".join(text), finish


def test_the_image_runs_as_a_user_and_keeps_no_build_extras(stack, report):
    image = run(["docker", "image", "inspect", "-f", "{{.Config.User}} {{.Size}}", "pagedserve:latest"]).stdout.split()
    report(f"image pagedserve:latest: {int(image[1]) / 1e6:.0f} MB")
    assert image[0] == "pagedserve"
    for container in stack.containers():
        uid = run(["docker", "exec", container, "id", "-u"]).stdout.strip()
        assert uid != "0", f"{stack.service_of(container)} runs as root"
    found = run(["docker", "run", "--rm", "-u", "0", "pagedserve:latest", "sh", "-c",
                 "find / -xdev \\( -name 'torch-*.whl' -o -name ca.crt -o -path /tmp/extras \\) -print"]).stdout
    assert found.strip() == "", f"build extras left in the image: {found}"


def test_chat_answers_paris(stack):
    reply = client(stack).chat.completions.create(
        model="smollm2-135m-instruct", temperature=0, max_tokens=32,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    worker_logs = stack.logs(stack.containers("worker")[0])
    assert "CPU kernels unavailable" not in worker_logs, "the worker's kernels did not build in its container"


def test_three_tokenizer_containers_each_serve_jobs(stack):
    stack("up", "-d", "--scale", "tokenizer=3")
    stack.wait_healthy(HEALTHY_TIMEOUT)
    tokenizers = stack.containers("tokenizer")
    assert len(tokenizers) == 3
    api = client(stack)

    def serving() -> set[str]:
        """The containers whose lines in `docker compose logs tokenizer` (prefixed with the
        container's name) say a tokenizer process served a job."""
        lines = stack("logs", "--no-color", "tokenizer").stdout.splitlines()
        return {line.split("|", 1)[0].strip() for line in lines if "served its first job" in line}

    def one_round() -> bool:  # a burst of requests: the router spreads them over idle workers
        with ThreadPoolExecutor(12) as pool:
            list(pool.map(lambda i: api.completions.create(model="smollm2-135m-instruct", max_tokens=1,
                                                           prompt=f"Count to {i}:"), range(12)))
        return len(serving()) == 3

    wait_for(one_round, "every tokenizer container to serve a job", timeout=180, interval=0)
    assert all("tokenizer" in name for name in serving())


def test_health_and_metrics_through_the_published_port(stack):
    base = f"http://127.0.0.1:{stack.port}"
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    served = [line for line in metrics.splitlines()
              if line.startswith("pagedserve:request_success_total") and not line.endswith(" 0.0")]
    assert served, "no finished requests counted in /metrics"
    assert "pagedserve:num_requests_running" in metrics and "pagedserve:kv_cache_usage_perc" in metrics


def restart_worker_by_crash(stack) -> None:
    """SIGKILL the worker container's processes, as the OOM killer would, and wait for its
    restart policy to start it again (a `docker kill` counts as a stop by hand on Docker 20.10,
    and the policy leaves such a container down)."""
    (worker,) = stack.containers("worker")
    before = stack.inspect(worker)["RestartCount"]
    os.kill(stack.inspect(worker)["State"]["Pid"], signal.SIGKILL)
    wait_for(lambda: stack.inspect(worker)["RestartCount"] > before, "the worker's restart by policy",
             timeout=60, interval=0.2)


@pytest.fixture(scope="module")
def reference(stack) -> list[tuple[str, str]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: stream_completion(client(stack), p), PROMPTS))


DISRUPTIONS = {  # compose commands run one after the other
    "worker crash": None,
    # `kill` is a stop by hand to Docker 20.10: the restart policy leaves the container down.
    "kill worker, then start it": [["kill", "-s", "SIGKILL", "worker"], ["start", "worker"]],
    "restart scheduler": [["restart", "scheduler"]],
    "restart tokenizer": [["restart", "tokenizer"]],
    "restart tokenizer-router": [["restart", "tokenizer-router"]],
    # What an upgrade of one component does once the new image is built.
    "recreate scheduler": [["up", "-d", "--no-deps", "--force-recreate", "scheduler"]],
}


@pytest.mark.parametrize("disruption", list(DISRUPTIONS))
def test_sixteen_greedy_requests_survive(stack, reference, disruption):
    """Half the requests are generating when the component goes, the other half arrive while it is
    away; all 16 complete with the fault-free run's outputs."""
    api = client(stack)
    if disruption == "worker crash":
        disrupt = lambda: restart_worker_by_crash(stack)  # noqa: E731
    else:
        disrupt = lambda: [stack(*command) for command in DISRUPTIONS[disruption]]  # noqa: E731
    half = len(PROMPTS) // 2
    started = [threading.Event() for _ in range(half)]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        early = [pool.submit(stream_completion, api, p, e) for p, e in zip(PROMPTS[:half], started)]
        wait_for(lambda: all(e.is_set() for e in started) or any(f.done() for f in early),
                 "the first requests to stream", timeout=300)
        assert not any(f.done() for f in early), "a request finished before the disruption"
        outage = threading.Thread(target=disrupt)
        outage.start()
        time.sleep(1.0)
        late = [pool.submit(stream_completion, api, p) for p in PROMPTS[half:]]
        outage.join()
        outputs = [f.result() for f in early + late]
    assert outputs == reference
    stack.wait_healthy(HEALTHY_TIMEOUT)


def test_an_api_key_is_required_once_set(stack):
    stack("up", "-d", "--scale", "tokenizer=3", env={"PAGEDSERVE_API_KEY": "compose-secret"})
    stack.wait_healthy(HEALTHY_TIMEOUT)
    for key in ("none", "wrong-key"):
        with pytest.raises(openai.AuthenticationError) as error:
            client(stack, key).models.list()
        assert error.value.status_code == 401
    reply = client(stack, "compose-secret").completions.create(model="smollm2-135m-instruct", prompt="Hi",
                                                               max_tokens=2)
    assert reply.usage.completion_tokens == 2


def test_down_leaves_nothing(stack):
    stack("down", "-v")
    assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
