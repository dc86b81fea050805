"""vLLM's request extras through the real frontend and tokenizer pool (fake
scheduler): allowed_token_ids and bad_words (tokenized in the pool) reach the
engine, truncate_prompt_tokens cuts the prompt that runs (and what usage and
echo report), return_tokens_as_token_ids names logprob tokens by id; bad
values are OpenAI-style 400s and gRPC INVALID_ARGUMENT."""
from __future__ import annotations

import httpx
import openai
import pytest

import grpc
from common.bad_words import spellings
from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc
from tests.frontend.conftest import MAX_MODEL_LEN
from tests.frontend.test_api_errors import assert_error
from tests.frontend.test_sampling_fields import post, sent, sent_over_http

CHAT = [{"role": "user", "content": "Say hello to me, how are you today?"}]
PROMPT = "Hello, world! How are you today?"


def expected_bad_word_ids(tokenizer, word: str) -> list[list[int]]:
    plain, spaced = (tokenizer.encode(text, add_special_tokens=False) for text in spellings(word))
    return [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])


def client(server, request_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0,
                         default_headers={"X-Request-Id": request_id})


def test_allowed_token_ids_and_bad_words_reach_the_engine(server):
    words = ["hello", " world today"]
    body = {"prompt": PROMPT, "max_tokens": 3, "allowed_token_ids": [5, 9, 11], "bad_words": words}
    assert post(server, "/completions", body, "extras-1").status_code == 200
    params = sent_over_http(server, "cmpl-extras-1", 0).sampling_params
    assert params.allowed_token_ids == [5, 9, 11]
    expected = [ids for word in words for ids in expected_bad_word_ids(server.tokenizer, word)]
    assert params.bad_words_token_ids == expected and len(expected) > 2  # some word kept both spellings
    client(server, "extras-2").chat.completions.create(
        model="tiny-model", messages=CHAT, max_completion_tokens=2,
        extra_body={"allowed_token_ids": [7], "bad_words": ["hello"]})
    params = sent_over_http(server, "chatcmpl-extras-2").sampling_params
    assert params.allowed_token_ids == [7]
    assert params.bad_words_token_ids == expected_bad_word_ids(server.tokenizer, "hello")


def test_truncation_runs_the_prompts_last_tokens_and_reports_them(server):
    ids = server.tokenizer.encode(PROMPT)
    reply = client(server, "extras-3").completions.create(
        model="tiny-model", prompt=PROMPT, max_tokens=2, echo=True, logprobs=1,
        extra_body={"truncate_prompt_tokens": 3})
    assert sent_over_http(server, "cmpl-extras-3", 0).prompt_token_ids == ids[-3:]
    assert reply.usage.prompt_tokens == 3
    echoed = server.tokenizer.decode(ids[-3:])
    assert reply.choices[0].text.startswith(echoed) and not reply.choices[0].text.startswith(PROMPT)
    assert len(reply.choices[0].logprobs.tokens) == 3 + 2  # the echoed prompt is what ran
    # Token prompts too; -1 keeps up to max_model_len (all of this one); more than the prompt keeps it whole.
    for request_id, prompt, truncate, kept in [("extras-4", ids, 2, ids[-2:]), ("extras-5", PROMPT, -1, ids),
                                               ("extras-6", PROMPT, 100, ids)]:
        body = {"prompt": prompt, "max_tokens": 2, "truncate_prompt_tokens": truncate}
        assert post(server, "/completions", body, request_id).json()["usage"]["prompt_tokens"] == len(kept)
        assert sent_over_http(server, f"cmpl-{request_id}", 0).prompt_token_ids == kept


def test_chat_truncation_cuts_the_rendered_prompt(server):
    whole = client(server, "extras-7").chat.completions.create(model="tiny-model", messages=CHAT,
                                                               max_completion_tokens=2)
    rendered = sent_over_http(server, "chatcmpl-extras-7").prompt_token_ids
    assert whole.usage.prompt_tokens == len(rendered) > 4
    cut = client(server, "extras-8").chat.completions.create(
        model="tiny-model", messages=CHAT, max_completion_tokens=2, extra_body={"truncate_prompt_tokens": 4})
    assert sent_over_http(server, "chatcmpl-extras-8").prompt_token_ids == rendered[-4:]
    assert cut.usage.prompt_tokens == 4
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client(server, "extras-8b").chat.completions.create(
            model="tiny-model", messages=CHAT, extra_body={"truncate_prompt_tokens": 0})


def test_return_tokens_as_token_ids_in_completions(server):
    script = server.scheduler.script
    for stream in (False, True):
        body = {"model": "tiny-model", "prompt": "Hi", "max_tokens": 3, "logprobs": 1, "stream": stream,
                "return_tokens_as_token_ids": True}
        response = httpx.post(server.api_url + "/completions", json=body, timeout=30)
        assert response.status_code == 200
        if stream:
            chunks = [httpx.Response(200, content=line[6:]).json() for line in response.text.splitlines()
                      if line.startswith("data: {")]
            tokens = [t for c in chunks for choice in c["choices"] if choice["logprobs"]
                      for t in choice["logprobs"]["tokens"]]
            assert tokens == [f"token_id:{t}" for t in script[:3]]
            continue
        logprobs = response.json()["choices"][0]["logprobs"]
        assert logprobs["tokens"] == [f"token_id:{t}" for t in script[:3]]
        assert logprobs["top_logprobs"] == [{f"token_id:{t}": -0.5} for t in script[:3]]
        # Offsets still count the text's characters.
        texts = [server.tokenizer.decode([t]) for t in script[:3]]
        assert logprobs["text_offset"] == [0, len(texts[0]), len(texts[0]) + len(texts[1])]
    body = {**body, "stream": False, "return_tokens_as_token_ids": False}
    logprobs = httpx.post(server.api_url + "/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [server.tokenizer.decode([t]) for t in script[:3]]


def test_return_tokens_as_token_ids_in_chat(server):
    reply = client(server, "extras-9").chat.completions.create(
        model="tiny-model", messages=CHAT, max_completion_tokens=2, logprobs=True, top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True})
    content = reply.choices[0].logprobs.content
    script = server.scheduler.script
    assert [entry.token for entry in content] == [f"token_id:{t}" for t in script[:2]]
    for entry, token in zip(content, script):
        assert entry.bytes == list(f"token_id:{token}".encode())
        assert [(top.token, top.bytes) for top in entry.top_logprobs] == [(entry.token, entry.bytes)]


@pytest.mark.parametrize("field, value, fragment", [
    ("allowed_token_ids", [], "non-empty"), ("allowed_token_ids", [-1], "non-negative"),
    ("allowed_token_ids", [1_000_000], "out of vocabulary"), ("allowed_token_ids", "abc", "allowed_token_ids"),
    ("bad_words", [""], "non-blank"), ("bad_words", "hello", "bad_words"), ("bad_words.0", [3], "valid string"),
    ("truncate_prompt_tokens", 0, "at least 1"), ("truncate_prompt_tokens", -2, "truncate_prompt_tokens"),
    ("truncate_prompt_tokens", MAX_MODEL_LEN + 1, "greater than max_model_len"),
    ("truncate_prompt_tokens", "many", "truncate_prompt_tokens"),
    ("return_tokens_as_token_ids", "maybe", "return_tokens_as_token_ids"),
])
@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_bad_values_are_400s(server, path, field, value, fragment):
    body = {"model": "tiny-model", "max_tokens": 2, field.split(".")[0]: value,
            **({"prompt": PROMPT} if path == "/completions" else {"messages": CHAT})}
    assert_error(httpx.post(server.api_url + path, json=body, timeout=30), 400, field, fragment)


def test_grpc_carries_the_extras_and_refuses_bad_ones(server):
    ids = server.tokenizer.encode(PROMPT)
    proto = pb.SamplingParams(max_tokens=2, allowed_token_ids=[4, 8], bad_words=["hello"], truncate_prompt_tokens=3)
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pagedserve_pb2_grpc.PagedServeStub(channel)
        replies = list(stub.Generate(pb.GenerateRequest(request_id="grpc-extras", text=PROMPT, echo=True,
                                                        sampling_params=proto), timeout=30))
        request = sent(server, "grpc-extras")
        assert request.prompt_token_ids == ids[-3:] and replies[-1].usage.prompt_tokens == 3
        assert replies[0].text.startswith(server.tokenizer.decode(ids[-3:]))
        assert request.sampling_params.allowed_token_ids == [4, 8]
        assert request.sampling_params.bad_words_token_ids == expected_bad_word_ids(server.tokenizer, "hello")
        for bad in (pb.SamplingParams(truncate_prompt_tokens=0), pb.SamplingParams(allowed_token_ids=[10**6]),
                    pb.SamplingParams(bad_words=[" "])):
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=bad), timeout=30))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_server_flag_names_tokens_by_id_unless_a_request_says_otherwise(server, tmp_path):
    from frontend.frontend_cli import build_parser
    from frontend.frontend_options import frontend_options_argv
    from tests.frontend.conftest import start_frontend

    # serve hands the flag on to its frontends.
    assert "--return-tokens-as-token-ids" in frontend_options_argv(
        build_parser().parse_args(["--return-tokens-as-token-ids"]))
    frontend, base_url, _ = start_frontend([*server.frontend_args, "--return-tokens-as-token-ids"],
                                           tmp_path / "frontend.log")
    try:
        body = {"model": "tiny-model", "prompt": "Hi", "max_tokens": 1, "logprobs": 0}
        tokens = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
        assert tokens["tokens"] == [f"token_id:{server.scheduler.script[0]}"]
        body["return_tokens_as_token_ids"] = False
        tokens = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30).json()["choices"][0]["logprobs"]
        assert tokens["tokens"] == [server.tokenizer.decode([server.scheduler.script[0]])]
    finally:
        frontend.stop()
