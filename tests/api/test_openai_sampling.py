"""Acceptance 2, 4 and 5 through the real `openai` client against the real
process split: seeds, n samples computed from one prefill, stop strings
across token boundaries, min_tokens, echo, usage chunks; and the shapes of
prompts, choices and chat messages OpenAI documents."""
from __future__ import annotations

import random

import openai
import pytest

from common.config import EngineConfig
from common.tokenizer import apply_chat_template
from serve_helpers import MODEL, metric_samples

BLOCK = EngineConfig().block_size  # the server's default block size
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def completion_text(client, **kwargs) -> str:
    return client.completions.create(model=MODEL, **kwargs).choices[0].text


def test_the_same_seed_gives_the_same_text_and_different_seeds_differ(client):
    kwargs = dict(prompt="My favourite animal is", temperature=1.0, max_tokens=8)
    first = completion_text(client, seed=7, **kwargs)
    assert completion_text(client, seed=7, **kwargs) == first
    others = {completion_text(client, seed=seed, **kwargs) for seed in (8, 9)}
    assert first not in others and len(others) == 2


def test_n_samples_are_distinct_and_the_prompt_is_computed_once(server, client, tokenizer):
    rng = random.Random(4)
    words = [rng.randrange(1000, 40000) for _ in range(4 * BLOCK + 1)]  # 4 full blocks, then 1 token
    before = metric_samples(server)
    response = client.completions.create(model=MODEL, prompt=words, n=4, temperature=1.0, seed=3, max_tokens=6,
                                         extra_body={"ignore_eos": True})
    after = metric_samples(server)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert len({c.text for c in response.choices}) == 4
    assert response.usage.prompt_tokens == len(words) and response.usage.completion_tokens == 24

    def delta(name: str) -> float:
        return after[f"pagedserve:{name}"] - before.get(f"pagedserve:{name}", 0.0)
    # Sample 0 looked the prompt up and computed it; the other 3 reused its 4 full blocks.
    assert delta("prefix_cache_queries_total") == 4 * len(words)
    assert delta("prefix_cache_hits_total") == 3 * 4 * BLOCK
    # Each sample has its own seed stream: sample i equals a lone request with seed + i.
    alone = completion_text(client, prompt=words, temperature=1.0, seed=3 + 2, max_tokens=6,
                            extra_body={"ignore_eos": True})
    assert alone == response.choices[2].text


def test_prompt_lists_and_choice_numbering(client, tokenizer):
    prompts = ["Roses are red,", "One, two, three,"]
    response = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=2, echo=True, temperature=1.0,
                                         seed=1)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:  # prompt_index * n + sample_index
        assert choice.text.startswith(prompts[choice.index // 2])
    ids = [tokenizer.encode(p) for p in prompts]
    by_ids = client.completions.create(model=MODEL, prompt=ids, n=2, max_tokens=2, echo=True, temperature=1.0,
                                       seed=1)
    assert [c.text for c in by_ids.choices] == [c.text for c in response.choices]
    single = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=1, temperature=0, echo=True)
    assert single.choices[0].text.startswith(prompts[1])
    assert response.usage.prompt_tokens == sum(len(i) for i in ids)


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(client):
    kwargs = dict(model=MODEL, prompt="The weather today is", temperature=1.0, seed=11, max_tokens=4)
    samples = client.completions.create(n=4, logprobs=0, **kwargs).choices
    ranked = sorted(samples, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    best = client.completions.create(n=2, best_of=4, **kwargs).choices
    assert [c.text for c in best] == [c.text for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1] and best[0].logprobs is None


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_spanning_a_token_boundary(client, include):
    kwargs = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=10)
    full = client.completions.create(logprobs=0, **kwargs).choices[0]
    tokens = full.logprobs.tokens
    k = next(i for i in range(2, len(tokens)) if len(tokens[i - 1].strip()) >= 2 and len(tokens[i].strip()) >= 2)
    stop = tokens[k - 1][-2:] + tokens[k][:2]  # the end of one token and the start of the next
    start = full.text.index(stop)
    response = client.completions.create(stop=[stop], extra_body={"include_stop_str_in_output": include}, **kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert choice.text == full.text[:start + (len(stop) if include else 0)]
    streamed = client.completions.create(stop=[stop], stream=True, extra_body={"include_stop_str_in_output": include},
                                         **kwargs)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached(client, tokenizer):
    messages = [{"role": "user", "content": "Answer yes or no: is the sky blue?"}]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    natural = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                             logprobs=True)
    natural_len = natural.usage.completion_tokens
    assert natural.choices[0].finish_reason == "stop" and natural_len < 6
    longer = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=natural_len + 4,
                                            logprobs=True, extra_body={"min_tokens": natural_len + 3})
    tokens = [entry.token for entry in longer.choices[0].logprobs.content]
    assert len(tokens) >= natural_len + 3
    assert "<|im_end|>" not in tokens[:natural_len + 3]  # the worker never sampled it early
    # A stop token id that would end the reply at once is held off as well.
    first = tokenizer.encode(natural.choices[0].logprobs.content[0].token)[0]
    stopped = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8,
                                             extra_body={"stop_token_ids": [first, eos]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].model_extra["stop_reason"] == first
    held = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=5, logprobs=True,
                                          extra_body={"stop_token_ids": [first], "min_tokens": 3})
    assert held.usage.completion_tokens >= 3
    assert tokenizer.decode([first]) not in [e.token for e in held.choices[0].logprobs.content[:3]]


def test_echo_returns_the_prompt_first(client, tokenizer):
    prompt = "Once upon a time"
    plain = completion_text(client, prompt=prompt, temperature=0, max_tokens=3)
    assert completion_text(client, prompt=prompt, temperature=0, max_tokens=3, echo=True) == prompt + plain
    streamed = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=3, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt + plain


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_include_usage_chunk_equals_the_non_streamed_usage(client, api):
    if api == "chat":
        kwargs = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5, n=2)
        create = client.chat.completions.create
    else:
        kwargs = dict(model=MODEL, prompt=["Hello there", "Water boils at"], temperature=0, max_tokens=4)
        create = client.completions.create
    # Own prefix-cache namespaces, so the second run finds no more cached tokens than the first.
    usage = create(extra_body={"cache_salt": f"{api}-plain"}, **kwargs).usage
    chunks = list(create(stream=True, stream_options={"include_usage": True},
                         extra_body={"cache_salt": f"{api}-streamed"}, **kwargs))
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.model_dump() == usage.model_dump()
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_roles_deltas_and_choices(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5, n=2,
                                                 stream=True))
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5, n=2)
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and all(c.delta.role is None for c in mine[1:])
        assert "".join(c.delta.content or "" for c in mine) == full.choices[index].message.content
        assert [c.finish_reason for c in mine][-1] == full.choices[index].finish_reason
    assert len({c.id for c in chunks}) == 1 and full.system_fingerprint


def test_chat_messages_roles_parts_and_template_options(client, tokenizer):
    conversation = [{"role": "system", "content": "You answer briefly."},
                    {"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]},
                    {"role": "assistant", "content": "Apple."},
                    {"role": "tool", "content": "no result", "tool_call_id": "call-1"},
                    {"role": "user", "content": "Another one?"}]
    response = client.chat.completions.create(model=MODEL, messages=conversation, temperature=0, max_tokens=1)
    as_strings = [{**m, "content": "Name a fruit."} if m["role"] == "user" and isinstance(m["content"], list) else m
                  for m in conversation]
    assert response.usage.prompt_tokens == len(apply_chat_template(tokenizer, as_strings))
    # continue_final_message: the reply continues the last assistant message, echo prepends it.
    partial = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    continued = client.chat.completions.create(
        model=MODEL, messages=partial, temperature=0, max_tokens=3,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True})
    text = continued.choices[0].message.content
    assert text.startswith("The capital of France is") and "Paris" in text
    prompt = apply_chat_template(tokenizer, partial, add_generation_prompt=False, continue_final_message=True)
    assert continued.usage.prompt_tokens == len(prompt)
    kwargs = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=1,
                                            extra_body={"chat_template_kwargs": {"unused_variable": 1}})
    assert kwargs.choices[0].message.content


def test_priority_user_and_skip_special_tokens_are_accepted(client):
    response = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, temperature=0, user="alice",
                                         extra_body={"priority": -5, "skip_special_tokens": False,
                                                     "spaces_between_special_tokens": False})
    assert response.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, extra_body={"priority": "high"})


def test_vllm_extras_steer_the_real_model(client, tokenizer):
    """allowed_token_ids, bad_words, truncate_prompt_tokens and return_tokens_as_token_ids
    on SmolLM2 through the whole process split (the token-id labels show what was sampled)."""
    def sampled_ids(prompt, **extra) -> list[int]:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, logprobs=0,
                                          temperature=extra.pop("temperature", 0), seed=1,
                                          extra_body={"return_tokens_as_token_ids": True, **extra})
        return [int(token.removeprefix("token_id:")) for token in reply.choices[0].logprobs.tokens]

    prompt = "The capital of France is"
    free = sampled_ids(prompt)
    word = tokenizer.decode(free[:1]).strip()
    banned = [tokenizer.encode(text, add_special_tokens=False) for text in (word, " " + word)]
    steered = sampled_ids(prompt, bad_words=[word])
    assert steered != free
    assert not any(steered[i:i + len(ids)] == ids for ids in banned for i in range(len(steered)))
    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    assert set(sampled_ids(prompt, temperature=1.0, allowed_token_ids=allowed, ignore_eos=True)) <= set(allowed)
    question = tokenizer.encode(prompt)
    padded = tokenizer.encode("Lorem ipsum dolor sit amet, consectetur adipiscing elit. ") + question
    assert sampled_ids(padded, truncate_prompt_tokens=len(question)) == free
