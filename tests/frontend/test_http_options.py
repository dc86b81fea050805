"""vLLM's frontend settings (handed on by `serve` too): CORS, so a browser page
may call the API (every origin by default, as vLLM; a preflight needs no API
key), --response-role, and the logs: uvicorn's access log (on by default, as
vLLM) and --enable-log-requests with --max-log-len."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc as pb_grpc
from test_cli_errors import assert_clear_error, run
from tests.frontend.conftest import start_frontend

PAGE = "https://chat.example"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
MESSAGES = [{"role": "user", "content": "Say hello"}]


def test_every_origin_may_call_the_api_by_default(server):
    preflight = httpx.options(f"{server.api_url}/chat/completions", headers=PREFLIGHT, timeout=10)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    models = httpx.get(f"{server.api_url}/models", headers={"Origin": PAGE}, timeout=10)
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "*"


@pytest.fixture(scope="module")
def restricted(server, tmp_path_factory):
    """A frontend that lets one origin in, needs an API key and answers as "bot"."""
    frontend, base_url, grpc_address = start_frontend(
        [*server.frontend_args, "--allowed-origins", f'["{PAGE}"]', "--allow-credentials",
         "--api-key", "sesame", "--response-role", "bot"], tmp_path_factory.mktemp("restricted") / "frontend.log")
    yield base_url, grpc_address
    frontend.stop()


def test_only_the_allowed_origin_and_its_preflight_needs_no_key(restricted):
    restricted, _ = restricted
    preflight = httpx.options(f"{restricted}/v1/chat/completions", headers=PREFLIGHT, timeout=10)
    assert preflight.status_code == 200  # browsers send no Authorization on a preflight
    assert preflight.headers["access-control-allow-origin"] == PAGE
    assert preflight.headers["access-control-allow-credentials"] == "true"
    other = httpx.options(f"{restricted}/v1/chat/completions", timeout=10,
                          headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    # The key is still needed for the call itself, and the page can read the refusal.
    refused = httpx.post(f"{restricted}/v1/chat/completions", headers={"Origin": PAGE}, timeout=10,
                         json={"model": "tiny-model", "messages": MESSAGES})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == PAGE
    assert "API key" in refused.json()["error"]["message"]


def test_replies_that_open_a_turn_take_the_response_role(restricted):
    restricted, grpc_address = restricted
    client = openai.OpenAI(base_url=f"{restricted}/v1", api_key="sesame", max_retries=0)
    reply = client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_tokens=2)
    assert reply.choices[0].message.role == "bot"
    chunks = list(client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_tokens=2, stream=True))
    assert chunks[0].choices[0].delta.role == "bot"
    continued = client.chat.completions.create(  # a continued turn keeps its own role
        model="tiny-model", messages=MESSAGES, max_tokens=2,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert continued.choices[0].message.role == "user"
    # gRPC's echo follows the same role: a last message of the reply's role is repeated.
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi"), pb.ChatMessage(role="bot", content="Yo")])
    with grpc.insecure_channel(grpc_address) as channel:
        responses = list(pb_grpc.PagedServeStub(channel).Generate(
            pb.GenerateRequest(chat=chat, echo=True, sampling_params=pb.SamplingParams(max_tokens=2)),
            metadata=[("authorization", "Bearer sesame")], timeout=30))
    assert "".join(r.text for r in responses).startswith("Yo")


@pytest.mark.parametrize("flag, value", [("--allowed-origins", "*"), ("--allowed-headers", '["a", 1]')])
def test_a_bad_list_is_a_usage_error(flag, value):
    code, output = run(["frontend", flag, value])
    assert code == 2
    assert_clear_error(code, output, flag, "JSON list of strings")


def test_serve_hands_the_settings_to_the_frontend(tmp_path):
    from pagedserve.serve import build_parser, component_commands
    from frontend.frontend_cli import build_parser as frontend_parser

    args = build_parser().parse_args(["--allowed-origins", f'["{PAGE}"]', "--allow-credentials",
                                      "--response-role", "bot", "--enable-log-requests", "--max-log-len", "7",
                                      "--disable-uvicorn-access-log"])
    frontend = next(c for c in component_commands(args, str(tmp_path)) if c.name == "frontend")
    parsed = frontend_parser().parse_args(frontend.argv[1:])
    assert (parsed.allowed_origins, parsed.allow_credentials, parsed.response_role) == ([PAGE], True, "bot")
    assert parsed.allowed_methods == ["*"] and parsed.allowed_headers == ["*"]
    assert (parsed.enable_log_requests, parsed.max_log_len, parsed.disable_uvicorn_access_log) == (True, 7, True)
    defaults = frontend_parser().parse_args(next(
        c for c in component_commands(build_parser().parse_args([]), str(tmp_path)) if c.name == "frontend").argv[1:])
    assert (defaults.enable_log_requests, defaults.max_log_len, defaults.disable_uvicorn_access_log) == \
        (False, None, False)


def test_the_access_log_is_on_and_requests_are_not_logged_by_default(server):
    httpx.get(f"{server.api_url}/models", headers={"X-Request-Id": "access-log-probe"}, timeout=10)
    server.frontend.wait_for_log(r'"GET /v1/models HTTP/1.1" 200')
    assert "Received request" not in server.frontend.log()  # prompts are the clients' data


def test_enable_log_requests_logs_each_request_and_how_it_ended(server, tmp_path):
    frontend, base_url, _ = start_frontend([*server.frontend_args, "--enable-log-requests", "--max-log-len", "3",
                                            "--disable-uvicorn-access-log"], tmp_path / "frontend.log")
    try:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
        reply = client.completions.create(model="tiny-model", prompt="Say hello to me.", max_tokens=4)
        prompt_ids = server.tokenizer.encode("Say hello to me.")
        received = frontend.wait_for_log(rf"Received request {reply.id}\S*: prompt: (.*), prompt_token_ids "
                                         rf"\(first 3 of {len(prompt_ids)}\): (\[.*?\]), params: .*max_tokens=4")
        assert received.group(2) == str(prompt_ids[:3])
        assert received.group(1) == repr(server.tokenizer.decode(prompt_ids[:3]))
        frontend.wait_for_log(rf"Finished request {reply.id}\S*: length after 4 output tokens")
        assert "HTTP/1.1" not in frontend.log()  # --disable-uvicorn-access-log
    finally:
        frontend.stop()
