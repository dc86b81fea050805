"""Bad input: every case is a 4xx with OpenAI's error body, and the server
stays up. Then schemathesis fuzzes the frontend's own OpenAPI schema and
must find no server error."""
from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

import httpx
import pytest

from tests.reliability.conftest import API_KEY
from tests.reliability.stack import MAX_MODEL_LEN, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}
USER = [{"role": "user", "content": "hi"}]
COMPLETION = {"model": MODEL_NAME, "prompt": "one two", "max_tokens": 4}
CHAT = {"model": MODEL_NAME, "messages": USER, "max_tokens": 4}
FUZZ_EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", 300))
FUZZ_DERANDOMIZE = "PAGEDSERVE_FUZZ_EXAMPLES" not in os.environ  # the default run is reproducible


def post(stack, path: str, *, json=None, content: bytes | str | None = None, headers=None) -> httpx.Response:
    headers = {**AUTH, "Content-Type": "application/json", **(headers or {})}
    return httpx.post(stack.api_url + path, json=json, content=content, headers=headers, timeout=30)


def assert_openai_error(response: httpx.Response, status: int, *fragments: str) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    for fragment in fragments:
        assert fragment in error["message"], error
    return error


RAW_BODIES = {
    "truncated JSON": b'{"model": "tiny-model", "prompt": ',
    "not JSON at all": b"hello there",
    "a JSON array": b'[1, 2, 3]',
    "a JSON string": b'"prompt"',
    "JSON null": b"null",
    "invalid UTF-8": b'{"model": "tiny-model", "prompt": "\xff\xfe\xfd", "max_tokens": 4}',
    "empty body": b"",
}


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
@pytest.mark.parametrize("name", list(RAW_BODIES))
def test_unparseable_bodies_are_400(fast_stack, path, name):
    assert_openai_error(post(fast_stack, path, content=RAW_BODIES[name]), 400)


COMPLETION_CASES = [
    # (changes to a valid body, the parameter the error must name)
    ({"prompt": 5}, "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"prompt": [1.5, 2]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [10**6]}, "prompt"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 1e9}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -7}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"seed": 2**80}, "seed"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"stop": 7}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"stream": "sometimes"}, "stream"),
    ({"n": 0}, "n"),
    ({"n": 10**6}, "n"),
    ({"n": "two"}, "n"),
]


@pytest.mark.parametrize("changes, param", COMPLETION_CASES, ids=[str(c) for c, _ in COMPLETION_CASES])
def test_bad_completion_fields_are_400_naming_the_field(fast_stack, changes, param):
    error = assert_openai_error(post(fast_stack, "/completions", json={**COMPLETION, **changes}), 400)
    assert error["param"] == param or param in error["message"], error


CHAT_CASES = [
    {"messages": []},
    {"messages": "hello"},
    {"messages": [{}]},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": 5, "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": ["just a string"]},
    {"max_completion_tokens": -5},
    {"max_tokens": 10**9},
    {"messages": None},
]


@pytest.mark.parametrize("changes", CHAT_CASES, ids=[str(c) for c in CHAT_CASES])
def test_bad_chat_bodies_are_400(fast_stack, changes):
    assert_openai_error(post(fast_stack, "/chat/completions", json={**CHAT, **changes}), 400)


@pytest.mark.parametrize("path, body", [("/completions", {k: v for k, v in COMPLETION.items() if k != "prompt"}),
                                        ("/chat/completions", {k: v for k, v in CHAT.items() if k != "messages"})])
def test_missing_required_fields_are_400(fast_stack, path, body):
    error = assert_openai_error(post(fast_stack, path, json=body), 400)
    assert error["param"] in ("prompt", "messages")


def test_a_prompt_longer_than_max_model_len_names_both_lengths(fast_stack):
    prompt = list(range(1, 301))
    error = assert_openai_error(post(fast_stack, "/completions", json={**COMPLETION, "prompt": prompt}), 400,
                                str(len(prompt)), str(MAX_MODEL_LEN))
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path, body", [("/completions", COMPLETION), ("/chat/completions", CHAT)])
def test_an_unknown_model_is_404(fast_stack, path, body):
    error = assert_openai_error(post(fast_stack, path, json={**body, "model": "gpt-17"}), 404, "gpt-17")
    assert error["code"] == "model_not_found"


def test_an_oversized_body_is_413(fast_stack):
    big = {**COMPLETION, "prompt": "x" * (70 * 1024)}  # the stack allows 64 KiB
    error = assert_openai_error(post(fast_stack, "/completions", json=big), 413, str(64 * 1024))
    assert error["code"] == "request_too_large"


def test_an_oversized_chunked_body_is_413(fast_stack):
    """Without a Content-Length the limit applies to the bytes as they arrive."""
    def chunks():
        yield b'{"model": "tiny-model", "prompt": "'
        for _ in range(80):
            yield b"x" * 1024
        yield b'"}'
    response = httpx.post(fast_stack.api_url + "/completions", content=chunks(),
                          headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert assert_openai_error(response, 413)["code"] == "request_too_large"


def test_a_lying_content_length_does_not_hang_or_crash(fast_stack):
    """A client that announces more bytes than it sends, then hangs up."""
    url = urlparse(fast_stack.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\"")
    assert httpx.get(fast_stack.base_url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/completions", 405), ("POST", "/v1/nothing", 404),
                                                  ("DELETE", "/v1/models", 405)])
def test_unknown_routes_and_methods(fast_stack, method, path, status):
    assert_openai_error(httpx.request(method, fast_stack.base_url + path, headers=AUTH, timeout=10), status)


def test_the_server_is_still_up_and_serving(fast_stack):
    response = post(fast_stack, "/completions", json={**COMPLETION, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == fast_stack.expected_text(4)
    assert httpx.get(fast_stack.base_url + "/health", timeout=10).status_code == 200
    fast_stack.wait_all_blocks_free()


def test_schemathesis_finds_no_server_error(fast_stack):
    """Fuzz every operation of /openapi.json with schema-conforming and
    schema-violating inputs: a fixed, bounded set by default; set
    PAGEDSERVE_FUZZ_EXAMPLES=N for N fresh random ones."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(fast_stack.base_url + "/openapi.json", timeout=30)
    strategy = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    seen: dict[int, int] = {}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=FUZZ_DERANDOMIZE,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def no_server_error(case):
        response = case.call(base_url=fast_stack.base_url, headers=AUTH, timeout=30)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, f"{case.as_curl_command()}\n-> {response.status_code} {response.text}"

    no_server_error()
    assert sum(seen.values()) >= 100 and any(400 <= status < 500 for status in seen), seen
    assert httpx.get(fast_stack.base_url + "/health", timeout=10).status_code == 200
    fast_stack.wait_all_blocks_free(timeout=10)
