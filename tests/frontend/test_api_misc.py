"""/v1/models, /health, /metrics, /version, and aborting requests whose HTTP
client went away."""
import re

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.frontend.conftest import MAX_MODEL_LEN, SERVED_NAMES, wait_healthy


def test_models_lists_every_served_name(server):
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    models = client.models.list().data
    assert [m.id for m in models] == SERVED_NAMES
    assert all(m.object == "model" and m.owned_by == "pagedserve" for m in models)
    raw = httpx.get(server.api_url + "/models").json()
    assert raw["object"] == "list"
    assert [m["max_model_len"] for m in raw["data"]] == [MAX_MODEL_LEN] * len(SERVED_NAMES)


def test_models_retrieve_one_by_id(server):
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    card = client.models.retrieve("tiny-alias")
    assert (card.id, card.object, card.owned_by) == ("tiny-alias", "model", "pagedserve")
    assert httpx.get(server.api_url + "/models/tiny-alias").json()["max_model_len"] == MAX_MODEL_LEN
    # An unknown id, with or without an org prefix, is OpenAI's 404 naming the model.
    for unknown in ("gpt-4o", "some-org/tiny-model"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve(unknown)
        error = caught.value.body
        assert error["code"] == "model_not_found" and unknown in error["message"]


def test_health_follows_the_scheduler(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    server.control.healthy = False
    try:
        response = httpx.get(server.base_url + "/health")
        assert response.status_code == 503
        assert response.json()["error"]["message"] == "no worker"
    finally:
        server.control.healthy = True
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_version(server):
    assert httpx.get(server.base_url + "/version").json() == {"version": "0.1.0"}


def scrape(server) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}}."""
    response = httpx.get(server.base_url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_metrics_parse_and_count(server):
    model = (("model_name", "tiny-model"),)
    before = scrape(server)
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    client.completions.create(model="tiny-model", prompt="Hello", max_tokens=3)
    after = scrape(server)
    # From the scheduler's control service (tests/frontend/fakes.py STATS).
    assert after["pagedserve:num_requests_running"][model] == 3
    assert after["pagedserve:num_requests_waiting"][model] == 2
    assert after["pagedserve:kv_cache_usage_perc"][model] == 0.25
    assert after["pagedserve:prefix_cache_queries_total"][model] == 100
    assert after["pagedserve:prefix_cache_hits_total"][model] == 40
    assert after["pagedserve:num_preemptions_total"][model] == 1
    assert after["pagedserve:prompt_tokens_total"][model] == 500
    assert after["pagedserve:generation_tokens_total"][model] == 700
    # Measured in the frontend.
    length = (("finished_reason", "length"), *model)
    assert after["pagedserve:request_success_total"][length] == before["pagedserve:request_success_total"][length] + 1
    for reason in ("stop", "abort"):
        assert (("finished_reason", reason), *model) in after["pagedserve:request_success_total"]
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        name = f"pagedserve:{histogram}_count"
        assert after[name][model] >= before[name][model] + 1
    itl = "pagedserve:inter_token_latency_seconds_count"
    assert after[itl][model] >= before[itl][model] + 2  # 3 tokens, 2 gaps


def test_a_beam_search_counts_as_one_request(server):
    # Its steps are engine requests of their own; the client's request is the one measured.
    model, length = (("model_name", "tiny-model"),), (("finished_reason", "length"), ("model_name", "tiny-model"))
    before = scrape(server)
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    client.completions.create(model="tiny-model", prompt="Hello", max_tokens=3, n=2, extra_body={
        "use_beam_search": True, "ignore_eos": True})
    after = scrape(server)
    assert after["pagedserve:request_success_total"][length] == before["pagedserve:request_success_total"][length] + 1
    name = "pagedserve:e2e_request_latency_seconds_count"
    assert after[name][model] == before[name][model] + 1


def test_metrics_without_the_scheduler_omit_its_numbers(server):
    server.control.stop()
    try:
        samples = scrape(server)
        assert "pagedserve:num_requests_running" not in samples
        assert "pagedserve:request_success_total" in samples
    finally:
        server.control.start(server.control.address)
    wait_healthy(server.base_url + "/health", timeout=10)  # the control channel reconnects quickly


def slow_prompt(server) -> list[int]:
    return [server.slow_token, 5, 6]  # the fake scheduler streams this one slowly, forever


def test_stream_disconnect_aborts_the_request(server):
    body = {"prompt": slow_prompt(server), "max_tokens": None, "stream": True}
    with httpx.stream("POST", server.api_url + "/completions", json=body, timeout=30) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
    request_id = httpx.Response(200, content=first[len("data: "):]).json()["id"] + "-0"
    assert server.scheduler.wait_for(lambda r: request_id in r.aborts), "no Abort after the client left"


def test_one_x_request_id_on_concurrent_requests(server):
    """Clients and proxies may send one X-Request-Id on many requests: each still runs."""
    headers = {"X-Request-Id": "same"}
    body = {"prompt": slow_prompt(server), "max_tokens": None, "stream": True}
    with httpx.stream("POST", server.api_url + "/completions", json=body, headers=headers, timeout=30) as running:
        first = next(line for line in running.iter_lines() if line.startswith("data: "))
        assert '"error"' not in first
        second = httpx.post(server.api_url + "/completions", json={"prompt": "Hi", "max_tokens": 2},
                            headers=headers, timeout=30)
        assert second.status_code == 200, second.text
        assert second.json()["id"] == "cmpl-same"


@pytest.mark.parametrize("path, body", [
    ("/completions", {"max_tokens": None}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "`slow"}]}),
])
def test_non_streamed_disconnect_aborts_the_request(server, path, body):
    if path == "/completions":
        body = {**body, "prompt": slow_prompt(server)}
        pattern = "cmpl-gone-[0-9a-f]{8}-0"
    else:
        pattern = "chatcmpl-gone-[0-9a-f]{8}"  # X-Request-Id and a random suffix
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.api_url + path, json=body, headers={"X-Request-Id": "gone"}, timeout=0.5)
    assert server.scheduler.wait_for(lambda r: any(re.fullmatch(pattern, i) for i in r.aborts)), \
        "no Abort after the client left"
