"""/v1/completions through the real openai client against a real frontend
process (fake scheduler: every request continues with a fixed script)."""
import openai
import pytest

from common.sampling_params import SamplingParams

PROMPT = "Say hello to me."


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)


def script_text(server, num_tokens: int | None = None) -> str:
    return server.tokenizer.decode(server.scheduler.script[:num_tokens])


def last_request(server, request_id: str):
    return next(r for r in reversed(server.scheduler.snapshot().requests) if r.request_id == request_id)


def test_non_streamed_completion(server, client):
    response = client.completions.create(model="tiny-model", prompt=PROMPT, max_tokens=5)
    prompt_ids = server.tokenizer.encode(PROMPT)
    assert response.id.startswith("cmpl-")
    assert response.object == "text_completion"
    assert response.model == "tiny-model"
    assert response.system_fingerprint
    assert response.created > 0
    [choice] = response.choices
    assert choice.index == 0
    assert choice.text == script_text(server, 5)
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == 5
    assert response.usage.total_tokens == len(prompt_ids) + 5
    assert response.usage.prompt_tokens_details.cached_tokens == len(prompt_ids) // 2
    assert last_request(server, response.id + "-0").prompt_token_ids == prompt_ids


def test_stream_joins_to_the_non_streamed_text(server, client):
    full = client.completions.create(model="tiny-model", prompt=PROMPT, max_tokens=None)
    assert full.choices[0].finish_reason == "stop"  # the script ends with EOS
    assert full.choices[0].text == script_text(server)
    chunks = list(client.completions.create(model="tiny-model", prompt=PROMPT, max_tokens=None, stream=True))
    assert len(chunks) > 5
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert all(c.usage is None for c in chunks)


def test_stream_include_usage_adds_a_final_usage_chunk(server, client):
    chunks = list(client.completions.create(model="tiny-model", prompt=PROMPT, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    *token_chunks, usage_chunk = chunks
    assert usage_chunk.choices == []
    prompt_tokens = len(server.tokenizer.encode(PROMPT))
    assert usage_chunk.usage.prompt_tokens == prompt_tokens
    assert usage_chunk.usage.completion_tokens == 4
    assert usage_chunk.usage.total_tokens == prompt_tokens + 4
    assert all(c.usage is None for c in token_chunks)
    assert "".join(c.choices[0].text for c in token_chunks) == script_text(server, 4)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tokens_per_output", [1, 3])
def test_stop_string_spanning_tokens(server, client, stream, tokens_per_output):
    stop = "ld! H"  # spans " world", "!" and " How"
    script = server.scheduler.script
    tokens_to_stop = next(k for k in range(1, len(script) + 1) if stop in server.tokenizer.decode(script[:k]))
    assert tokens_to_stop >= 3
    server.scheduler.tokens_per_output = tokens_per_output
    try:
        if stream:
            chunks = list(client.completions.create(model="tiny-model", prompt=PROMPT, stop=[stop, "nowhere"],
                                                    max_tokens=None, stream=True,
                                                    stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0] for c in chunks if c.choices][-1]
            usage, request_id = chunks[-1].usage, chunks[0].id + "-0"
        else:
            response = client.completions.create(model="tiny-model", prompt=PROMPT, stop=stop, max_tokens=None)
            text, finish, usage = response.choices[0].text, response.choices[0], response.usage
            request_id = response.id + "-0"
    finally:
        server.scheduler.tokens_per_output = 1
    assert text == " Hello, wor"
    assert finish.finish_reason == "stop"
    assert finish.stop_reason == stop
    assert usage.completion_tokens == tokens_to_stop
    # The scheduler was told to stop generating.
    assert server.scheduler.wait_for(lambda r: request_id in r.aborts)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tokens_per_output", [1, 3])
def test_stop_strings_wait_for_min_tokens(server, client, stream, tokens_per_output):
    """As in vLLM: a stop string counts only once it ends after the first min_tokens tokens."""
    script, decode = server.scheduler.script, server.tokenizer.decode
    min_tokens, full = 3, decode(script)
    assert "o" in decode(script[:min_tokens])  # a match the min_tokens must skip
    start = full.index("o", len(decode(script[:min_tokens])))
    tokens_to_stop = next(k for k in range(1, len(script) + 1) if len(decode(script[:k])) > start)
    kwargs = dict(model="tiny-model", prompt=PROMPT, stop="o", max_tokens=None, extra_body={"min_tokens": min_tokens})
    server.scheduler.tokens_per_output = tokens_per_output
    try:
        if stream:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish, usage = [c.choices[0] for c in chunks if c.choices][-1], chunks[-1].usage
        else:
            response = client.completions.create(**kwargs)
            text, finish, usage = response.choices[0].text, response.choices[0], response.usage
    finally:
        server.scheduler.tokens_per_output = 1
    assert text == full[:start]
    assert (finish.finish_reason, finish.stop_reason) == ("stop", "o")
    assert usage.completion_tokens == tokens_to_stop


def test_include_stop_str_in_output(server, client):
    response = client.completions.create(model="tiny-model", prompt=PROMPT, stop="world", max_tokens=None,
                                         extra_body={"include_stop_str_in_output": True})
    assert response.choices[0].text == " Hello, world"


def test_stop_token_ids_finish_with_the_token_as_stop_reason(server, client):
    script = server.scheduler.script
    response = client.completions.create(model="tiny-model", prompt=PROMPT, max_tokens=None,
                                         extra_body={"stop_token_ids": [script[3]]})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.stop_reason == script[3]
    assert choice.text == script_text(server, 3)  # the stop token's own text is not output
    assert response.usage.completion_tokens == 4


def test_sampling_params_reach_the_scheduler(server, client):
    response = client.completions.create(
        model="tiny-model", prompt=PROMPT, max_tokens=7, temperature=0.5, top_p=0.9, seed=42,
        extra_body={"top_k": 5, "min_p": 0.1, "min_tokens": 2, "ignore_eos": True,
                    "stop_token_ids": [server.eos_token_id]})
    sent = last_request(server, response.id + "-0").sampling_params
    assert sent == SamplingParams(temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=42, max_tokens=7,
                                  min_tokens=2, ignore_eos=True, stop_token_ids=[server.eos_token_id])


def test_token_id_prompt_and_model_aliases(server, client):
    ids = server.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model="tiny-alias", prompt=ids, max_tokens=3)
    assert by_ids.choices[0].text == script_text(server, 3)
    assert by_ids.model == "tiny-model"  # responses name the first served name
    assert last_request(server, by_ids.id + "-0").prompt_token_ids == ids


def test_several_prompts_give_one_choice_each(server, client):
    prompts = [PROMPT, "Hello"]
    response = client.completions.create(model="tiny-model", prompt=prompts, max_tokens=3)
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [script_text(server, 3)] * 2
    prompt_tokens = sum(len(server.tokenizer.encode(p)) for p in prompts)
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 6
    chunks = list(client.completions.create(model="tiny-model", prompt=prompts, max_tokens=3, stream=True))
    for index in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == index) == script_text(server, 3)


def test_echo_prepends_the_prompt(server, client):
    response = client.completions.create(model="tiny-model", prompt=PROMPT, max_tokens=2, echo=True)
    assert response.choices[0].text == PROMPT + script_text(server, 2)
    chunks = list(client.completions.create(model="tiny-model", prompt=PROMPT, max_tokens=2, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + script_text(server, 2)


def test_request_id_header_names_the_response(server, client):
    response = client.completions.create(model="tiny-model", prompt=PROMPT, max_tokens=1,
                                         extra_headers={"X-Request-Id": "my-trace-id"})
    assert response.id == "cmpl-my-trace-id"


def test_echo_with_max_tokens_0_returns_only_the_prompt(server, client):
    """OpenAI's and vLLM's way to score a prompt: echo it with its logprobs, generate nothing."""
    prompt_ids = server.tokenizer.encode(PROMPT)
    response = client.completions.create(model="tiny-model", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    [choice] = response.choices
    assert choice.text == PROMPT
    assert choice.finish_reason == "length"
    assert choice.logprobs.tokens == [server.tokenizer.decode([t]) for t in prompt_ids]
    assert choice.logprobs.token_logprobs == [None] + [-1.0] * (len(prompt_ids) - 1)
    assert response.usage.completion_tokens == 0
    assert response.usage.total_tokens == response.usage.prompt_tokens == len(prompt_ids)
    chunks = list(client.completions.create(model="tiny-model", prompt=PROMPT, max_tokens=0, echo=True,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # without echo there is nothing to return
        client.completions.create(model="tiny-model", prompt=PROMPT, max_tokens=0)
