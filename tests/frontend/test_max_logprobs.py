"""--max-logprobs, as vLLM's: the engine's bound on logprobs and prompt_logprobs
per token (-1: the vocabulary), which frontends learn from the scheduler's
ModelInfo (the default, 20, from a scheduler that does not say). A frontend in
front of a fake control service that reports 40."""
from __future__ import annotations

import httpx
import pytest

from tests.frontend.conftest import MAX_MODEL_LEN, start_frontend
from local_ports import free_port
from tests.frontend.fakes import FakeControl


@pytest.fixture(scope="module")
def api_url(server, tmp_path_factory):
    control = FakeControl(MAX_MODEL_LEN, len(server.tokenizer), max_logprobs=40).start(f"127.0.0.1:{free_port()}")
    args = list(server.frontend_args)
    args[args.index("--scheduler-control-address") + 1] = control.address
    frontend, base_url, _ = start_frontend(args, tmp_path_factory.mktemp("max-logprobs") / "frontend.log")
    try:
        yield base_url + "/v1"
    finally:
        frontend.stop()
        control.stop()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": "tiny-model", "max_tokens": 2, **body}, timeout=30)


@pytest.mark.parametrize("path, body, param", [
    ("/completions", {"prompt": "Hi", "logprobs": {}}, "logprobs"),
    ("/completions", {"prompt": "Hi", "prompt_logprobs": {}}, "prompt_logprobs"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": {}},
     "top_logprobs")])
def test_the_engines_bound_holds(api_url, server, path, body, param):
    def asking(count: int) -> dict:
        return {key: count if value == {} else value for key, value in body.items()}

    assert post(api_url, path, asking(40)).status_code == 200
    refused = post(api_url, path, asking(41))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    assert "40" in refused.json()["error"]["message"]
    # The shared stack's scheduler does not say: the default bound, 20.
    assert post(server.api_url, path, asking(21)).status_code == 400


def test_beam_width_follows_the_bound(api_url):
    body = {"prompt": "Hi", "use_beam_search": True}
    refused = post(api_url, "/completions", {**body, "n": 21})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
    assert "1 to 20 beams" in refused.json()["error"]["message"]
