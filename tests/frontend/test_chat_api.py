"""/v1/chat/completions: prompts rendered by the real tokenizer pool, text
streamed from the fake scheduler's script."""
import openai
import pytest

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to me."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)


def rendered(server, messages, **kwargs) -> list[int]:
    text = server.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return server.tokenizer.encode(text, add_special_tokens=False)


def sent_prompt(server, request_id: str) -> list[int]:
    return next(r for r in server.scheduler.snapshot().requests if r.request_id == request_id).prompt_token_ids


def test_non_streamed_chat(server, client):
    response = client.chat.completions.create(model="tiny-model", messages=MESSAGES)
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    assert response.model == "tiny-model"
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == server.tokenizer.decode(server.scheduler.script)
    assert choice.finish_reason == "stop"
    prompt = rendered(server, MESSAGES)
    assert sent_prompt(server, response.id) == prompt
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == len(server.scheduler.script) + 1  # + EOS
    assert response.usage.prompt_tokens_details.cached_tokens == len(prompt) // 2


def test_stream_has_role_first_and_joins_to_the_same_text(server, client):
    full = client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_completion_tokens=8)
    chunks = list(client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_completion_tokens=8,
                                                 stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert full.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert full.usage.completion_tokens == 8


def test_stream_include_usage(server, client):
    chunks = list(client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(rendered(server, MESSAGES)), 3)
    assert usage.total_tokens == usage.prompt_tokens + 3
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(server, client, stream):
    kwargs = dict(model="tiny-model", messages=MESSAGES, stop=["are you", "! How"])
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
        request_id = chunks[0].id
    else:
        response = client.chat.completions.create(**kwargs)
        text, finish, request_id = response.choices[0].message.content, response.choices[0].finish_reason, response.id
    assert text == " Hello, world"
    assert finish == "stop"
    assert server.scheduler.wait_for(lambda r: request_id in r.aborts)


def test_content_parts_and_template_options(server, client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello"}]}]
    response = client.chat.completions.create(model="tiny-model", messages=parts, max_tokens=1)
    assert sent_prompt(server, response.id) == rendered(server, [{"role": "user", "content": "Say\nhello"}])
    continued = [*MESSAGES, {"role": "assistant", "content": "Hel"}]
    response = client.chat.completions.create(
        model="tiny-model", messages=continued, max_tokens=1,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    expected = server.tokenizer.apply_chat_template(continued, tokenize=False, continue_final_message=True)
    assert sent_prompt(server, response.id) == server.tokenizer.encode(expected, add_special_tokens=False)


def test_model_may_be_omitted(server):
    import httpx
    response = httpx.post(server.api_url + "/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    assert response.status_code == 200
    assert response.json()["model"] == "tiny-model"
