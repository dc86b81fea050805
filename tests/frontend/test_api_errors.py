"""Every bad request gets OpenAI's error body with the right status and the
offending parameter named; nothing reaches the scheduler for it."""
import httpx
import openai
import pytest

from tests.frontend.conftest import MAX_MODEL_LEN

CHAT = [{"role": "user", "content": "Hi"}]


def post(server, path: str, body) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    return httpx.post(server.api_url + path, headers={"Content-Type": "application/json"}, timeout=30, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None, *fragments: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for fragment in fragments:
        assert fragment in error["message"], error
    return error


@pytest.mark.parametrize("field, value, fragment", [
    ("temperature", -1, "temperature"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -2, "top_k"),
    ("min_p", 2, "min_p"),
    ("max_tokens", 0, "max_tokens"),
    ("min_tokens", 50, "min_tokens"),
    ("stop_token_ids", [-1], "stop_token_ids"),
    ("max_tokens", "many", "max_tokens"),  # a type error, caught by the body schema
    ("temperature", "hot", "temperature"),
    ("stop", 5, "stop"),
    ("stop", ["x"] * 257, "256"),
    ("min_tokens", 1 << 64, "min_tokens"),  # beyond what the wire carries: refused before any stream starts
    ("priority", 1 << 64, "priority"),
])
def test_bad_sampling_values_are_400s_naming_the_parameter(server, field, value, fragment):
    body = {"model": "tiny-model", "prompt": "Hi", "max_tokens": 16, field: value}
    error = assert_error(post(server, "/completions", body), 400, field, fragment)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("field, value", [("suffix", "end")])
def test_unsupported_completion_options_are_400s(server, field, value):
    body = {"model": "tiny-model", "prompt": "Hi", field: value}
    assert_error(post(server, "/completions", body), 400, field, "not supported")


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("fields, param", [({"tools": TOOLS}, "tools"),  # tool_choice "auto" by default
                                           ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
                                           ({"functions": [{"name": "f"}]}, "functions"),
                                           ({"function_call": {"name": "f"}}, "function_call")])
def test_unsupported_chat_options_are_400s(server, fields, param):
    body = {"model": "tiny-model", "messages": CHAT, **fields}
    assert_error(post(server, "/chat/completions", body), 400, param, "not supported")


@pytest.mark.parametrize("fields, param, fragment", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),  # never silently ignored
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "not in tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "not in tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "tools", "name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tool_choice": "required"},
     "tools", "parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "only one"),
])
def test_bad_tool_choices_are_400s(server, fields, param, fragment):
    body = {"model": "tiny-model", "messages": CHAT, **fields}
    assert_error(post(server, "/chat/completions", body), 400, param, fragment)


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
@pytest.mark.parametrize("field, value", [
    ("structural_tag", "{}"), ("guided_whitespace_pattern", " *"),
    ("logits_processors", ["my.Processor"]),
])
def test_unimplemented_vllm_options_are_400s_not_ignored(server, path, field, value):
    """vLLM's extra fields that change what is generated or returned: output that
    silently ignores them would look right and be wrong."""
    body = {"model": "tiny-model", "max_tokens": 2, field: value,
            **({"prompt": "Hi"} if path == "/completions" else {"messages": CHAT})}
    assert_error(post(server, path, body), 400, field, "not supported")
    # Their defaults ask for nothing.
    assert post(server, path, {**body, field: None}).status_code == 200


def test_chat_template_per_request_is_a_400(server):
    body = {"model": "tiny-model", "messages": CHAT, "max_tokens": 2, "chat_template": "{{ messages }}"}
    assert_error(post(server, "/chat/completions", body), 400, "chat_template", "not supported")


def test_tool_choice_none_needs_no_tools(server):
    body = {"model": "tiny-model", "messages": CHAT, "max_tokens": 2, "tool_choice": "none"}
    assert post(server, "/chat/completions", body).status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800 hi"}]}', "messages[0].content"),
    ("/chat/completions", '{"messages": [{"role": "\\udfff", "content": "hi"}]}', "messages[0].role"),
    ("/completions", '{"prompt": "hi", "stop": ["ok", "\\ud800"]}', "stop[1]"),
    ("/completions", '{"prompt": "hi", "model": "\\ud800"}', "model"),
    ("/completions", '{"prompt": ["fine", "\\udbff"]}', "prompt[1]"),
])
def test_lone_surrogates_are_400s(server, path, body, param):
    """JSON can spell half a UTF-16 pair; no text has one (a whole pair is fine)."""
    assert_error(post(server, path, body), 400, param, "surrogate")
    emoji = '{"prompt": "\\ud83d\\ude00", "max_tokens": 2}'
    assert post(server, "/completions", emoji).status_code == 200


def test_malformed_bodies(server):
    assert_error(post(server, "/chat/completions", {"model": "tiny-model"}), 400, "messages")
    assert_error(post(server, "/chat/completions", {"model": "tiny-model", "messages": []}), 400, "messages")
    assert_error(post(server, "/chat/completions", {"messages": [{"content": "no role"}]}), 400, "messages.0.role")
    assert_error(post(server, "/completions", {"model": "tiny-model"}), 400, "prompt")
    assert_error(post(server, "/completions", {"prompt": []}), 400, "prompt", "empty")
    assert_error(post(server, "/completions", '{"prompt": "Hi",'), 400, None, "JSON")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(post(server, "/chat/completions", {"messages": image}), 400, "messages", "takes no images")
    assert_error(post(server, "/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}),
                 400, "stream_options")


def test_unknown_model_is_404(server):
    error = assert_error(post(server, "/completions", {"model": "gpt-4", "prompt": "Hi"}), 404, "model", "gpt-4")
    assert error["code"] == "model_not_found"
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)


def test_prompt_too_long_names_both_lengths(server):
    too_long = [5] * (MAX_MODEL_LEN + 10)
    assert_error(post(server, "/completions", {"prompt": too_long, "max_tokens": None}), 400, "prompt",
                 str(MAX_MODEL_LEN), str(MAX_MODEL_LEN + 10))
    # Fits alone, but not with the requested completion.
    assert_error(post(server, "/completions", {"prompt": [5] * 100, "max_tokens": MAX_MODEL_LEN}), 400,
                 "max_tokens", str(MAX_MODEL_LEN), str(100 + MAX_MODEL_LEN))
    long_chat = [{"role": "user", "content": "Hello, world! " * 200}]
    assert_error(post(server, "/chat/completions", {"messages": long_chat}), 400, "messages", str(MAX_MODEL_LEN))
    assert_error(post(server, "/chat/completions", {"messages": CHAT, "max_completion_tokens": 1000}), 400,
                 "max_completion_tokens", str(MAX_MODEL_LEN))
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-model", prompt=too_long, max_tokens=None)
    assert info.value.status_code == 400


def test_min_tokens_beyond_the_context_is_a_400(server):
    """Without max_tokens the output may fill the context, but no more."""
    assert_error(post(server, "/completions", {"prompt": [5] * 10, "max_tokens": None, "min_tokens": MAX_MODEL_LEN}),
                 400, "min_tokens", str(MAX_MODEL_LEN - 10))


def test_out_of_vocabulary_token_ids_are_400s(server):
    vocab = len(server.tokenizer)
    assert_error(post(server, "/completions", {"prompt": [1, vocab]}), 400, "prompt", str(vocab))


def test_scheduler_rejection_becomes_a_400(server):
    before = len(server.scheduler.snapshot().requests)
    response = post(server, "/completions", {"prompt": [server.reject_token, 5], "max_tokens": 3})
    assert_error(response, 400, None, "rejected", f"max_model_len {MAX_MODEL_LEN}")
    assert len(server.scheduler.snapshot().requests) == before + 1  # it was the scheduler that said no
    # After the stream started, the same rejection arrives as an error event.
    with httpx.stream("POST", server.api_url + "/completions", timeout=30,
                      json={"prompt": [server.reject_token, 5], "max_tokens": 3, "stream": True}) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and "rejected" in lines[-2]


def test_bad_params_never_reach_the_scheduler(server):
    before = len(server.scheduler.snapshot().requests)
    post(server, "/completions", {"prompt": "Hi", "temperature": -1})
    post(server, "/chat/completions", {"messages": CHAT, "n": 0})
    assert len(server.scheduler.snapshot().requests) == before


def test_unknown_routes_use_the_same_error_shape(server):
    assert_error(httpx.get(server.api_url + "/nowhere"), 404, None, "Not Found")
    assert_error(httpx.get(server.api_url + "/completions"), 405, None, "Method Not Allowed")
