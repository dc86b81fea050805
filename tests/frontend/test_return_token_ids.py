"""vLLM's `return_token_ids`: the prompt's token ids and each choice's output
token ids in the reply, whole or streamed (the stream's pieces adding up to
the whole), and nothing of them unless asked for. Read with the `openai`
client from a real frontend in front of a fake scheduler that writes a script."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.frontend.tool_stack import ASK, TOOLS

PROMPTS = ["Say hello to me.", "Hello, world!"]
MESSAGES = [{"role": "user", "content": "Say hello to me."}]
ASKED = {"return_token_ids": True}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)


def scheduled_prompt(server, response_id: str) -> list[int]:
    """The prompt the scheduler got for a response (its first request with that id's prefix)."""
    return next(r.prompt_token_ids for r in reversed(server.scheduler.snapshot().requests)
                if r.request_id.startswith(response_id))


def test_completions_whole(server, client):
    response = client.completions.create(model="tiny-model", prompt=PROMPTS, n=2, max_tokens=6, echo=True,
                                         extra_body=ASKED)
    assert len(response.choices) == 4
    for choice in response.choices:
        prompt = PROMPTS[choice.index // 2]
        assert choice.prompt_token_ids == server.tokenizer.encode(prompt)
        assert len(choice.token_ids) == 6  # the echoed prompt is not among them
        assert prompt + server.tokenizer.decode(choice.token_ids) == choice.text


def test_completions_stream_adds_up_to_the_whole(server, client):
    request = dict(model="tiny-model", prompt=PROMPTS[0], max_tokens=None, extra_body=ASKED)
    [whole] = client.completions.create(**request).choices
    chunks = list(client.completions.create(**request, stream=True))
    assert chunks[0].choices[0].prompt_token_ids == whole.prompt_token_ids == server.tokenizer.encode(PROMPTS[0])
    assert all(getattr(chunk.choices[0], "prompt_token_ids", None) is None for chunk in chunks[1:])
    assert [t for chunk in chunks for t in chunk.choices[0].token_ids] == whole.token_ids
    assert whole.token_ids[-1] == server.eos_token_id  # the script ends with EOS, which the text does not show


def test_chat_whole_and_streamed(server, client):
    request = dict(model="tiny-model", messages=MESSAGES, n=2, max_tokens=7, extra_body=ASKED)
    whole = client.chat.completions.create(**request)
    assert whole.prompt_token_ids == scheduled_prompt(server, whole.id)
    assert [server.tokenizer.decode(c.token_ids) for c in whole.choices] == [c.message.content for c in whole.choices]
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    assert all(getattr(chunk, "prompt_token_ids", None) is None for chunk in chunks[1:])
    for index, choice in enumerate(whole.choices):
        streamed = [t for chunk in chunks for c in chunk.choices if c.index == index
                    for t in getattr(c, "token_ids", None) or []]
        assert streamed == choice.token_ids


def test_streamed_tool_calls_lose_no_token(tool_stack):
    # The tool-call tags are held back while they may begin a call: their tokens come with a later chunk.
    request = dict(model="tiny-model", messages=ASK, tools=TOOLS, extra_body=ASKED)
    whole = tool_stack.client.chat.completions.create(**request).choices[0]
    assert len(whole.message.tool_calls) == 2
    chunks = [chunk for chunk in tool_stack.client.chat.completions.create(**request, stream=True) if chunk.choices]
    assert [t for chunk in chunks for t in getattr(chunk.choices[0], "token_ids", None) or []] == whole.token_ids
    assert tool_stack.tokenizer.decode(whole.token_ids).startswith("Let me check both. <tool_call>")


@pytest.mark.parametrize("path, body", [("/completions", {"prompt": PROMPTS[0]}), ("/chat/completions",
                                                                                   {"messages": MESSAGES})])
@pytest.mark.parametrize("stream", [False, True])
def test_not_asked_for_no_token_ids_appear(server, path, body, stream):
    reply = httpx.post(server.api_url + path, json={"model": "tiny-model", "max_tokens": 3, "stream": stream,
                                                    **body}, timeout=30)
    assert reply.status_code == 200 and "token_ids" not in reply.text
    asked = httpx.post(server.api_url + path, json={"model": "tiny-model", "max_tokens": 3, "stream": stream,
                                                    "return_token_ids": True, **body}, timeout=30)
    assert "prompt_token_ids" in asked.text and '"token_ids"' in asked.text


def test_a_wrong_type_is_a_400(server):
    reply = httpx.post(server.api_url + "/completions", json={"model": "tiny-model", "prompt": "Hi",
                                                              "return_token_ids": "yes please"}, timeout=30)
    assert reply.status_code == 400 and json.loads(reply.text)["error"]["param"] == "return_token_ids"
