"""Acceptance 1: logprobs of the chosen tokens and of the top-5 alternatives
equal transformers' log-softmax at the same positions within 1e-3 (float32),
in the chat format, the legacy completions format, vLLM's prompt_logprobs,
and over gRPC. Through the real `openai` client and the generated gRPC stub."""
from __future__ import annotations

import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from common.tokenizer import apply_chat_template
from serve_helpers import MODEL

TOLERANCE = 1e-3
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three colors."}]
PROMPT = "The quick brown fox jumps over the"


def close(value: float, expected: float) -> bool:
    return abs(value - expected) <= TOLERANCE


def assert_top_matches(got: list[tuple[int | str, float]], row, decode=None) -> None:
    """`got`: (token id or text, logprob) of the top-k, best first, against the
    reference row. Tokens must agree except where the reference's logprobs tie."""
    expected = row.topk(len(got))
    for (token, logprob), ref_id, ref_logprob in zip(got, expected.indices.tolist(), expected.values.tolist()):
        assert close(logprob, ref_logprob), (token, logprob, ref_logprob)
        ref_token = decode(ref_id) if decode else ref_id
        assert token == ref_token or close(row[ref_id].item(), logprob)


def test_chat_logprobs_and_top_5_equal_transformers(client, tokenizer, reference):
    prompt = apply_chat_template(tokenizer, MESSAGES)
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8,
                                              logprobs=True, top_logprobs=5)
    content = response.choices[0].logprobs.content
    assert response.usage.prompt_tokens == len(prompt) and len(content) == response.usage.completion_tokens == 8
    token_ids = reference.greedy(prompt, 8)
    rows = reference.logprobs(prompt + token_ids)
    decode = lambda token_id: tokenizer.decode([token_id])  # noqa: E731
    for position, (entry, token_id) in enumerate(zip(content, token_ids)):
        row = rows[len(prompt) - 1 + position]
        assert entry.token == decode(token_id)
        assert bytes(entry.bytes).decode() == entry.token
        assert close(entry.logprob, row[token_id].item())
        assert len(entry.top_logprobs) == 5
        assert_top_matches([(t.token, t.logprob) for t in entry.top_logprobs], row, decode)
    assert "".join(e.token for e in content) == response.choices[0].message.content


def test_legacy_completion_logprobs_with_echo_equal_transformers(client, tokenizer, reference):
    response = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=5,
                                         echo=True)
    choice = response.choices[0]
    prompt = tokenizer.encode(PROMPT)
    token_ids = prompt + reference.greedy(prompt, 6)
    rows = reference.logprobs(token_ids)
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([t]) for t in token_ids]
    assert choice.text == PROMPT + "".join(logprobs.tokens[len(prompt):])
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, len(token_ids)):
        row = rows[position - 1]
        chosen = token_ids[position]
        assert close(logprobs.token_logprobs[position], row[chosen].item())
        top = logprobs.top_logprobs[position]  # the top 5 and the chosen token: up to 6 entries
        expected = {tokenizer.decode([t]): row[t].item() for t in [*row.topk(5).indices.tolist(), chosen]}
        assert set(top) == set(expected), position
        assert all(close(top[token], value) for token, value in expected.items())
    for offset, token in zip(logprobs.text_offset, logprobs.tokens):
        assert choice.text[offset:offset + len(token)] == token


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_prompt_logprobs_equal_transformers(client, tokenizer, reference, api):
    if api == "completions":
        prompt = tokenizer.encode(PROMPT)
        body = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                         extra_body={"prompt_logprobs": 5}).to_dict()
        prompt_logprobs = body["choices"][0]["prompt_logprobs"]
    else:
        prompt = apply_chat_template(tokenizer, MESSAGES)
        body = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0,
                                              extra_body={"prompt_logprobs": 5}).to_dict()
        prompt_logprobs = body["prompt_logprobs"]
    rows = reference.logprobs(prompt)
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entries = prompt_logprobs[position]
        row = rows[position - 1]
        actual = entries[str(prompt[position])]
        assert close(actual["logprob"], row[prompt[position]].item())
        assert actual["rank"] == int((row > row[prompt[position]]).sum()) + 1 or close(
            row.sort(descending=True).values[actual["rank"] - 1].item(), actual["logprob"])
        top = sorted(((int(t), e) for t, e in entries.items() if e["rank"] <= 5), key=lambda item: item[1]["rank"])
        assert [e["rank"] for _, e in top] == [1, 2, 3, 4, 5]
        assert_top_matches([(t, e["logprob"]) for t, e in top], row)
        assert actual["decoded_token"] == tokenizer.decode([prompt[position]])


def test_grpc_sampled_and_prompt_logprobs_equal_transformers(stub, tokenizer, reference):
    """Sampled at temperature 1: the stub returns token ids, so the reference
    scores exactly the tokens the server drew."""
    request = pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(
        temperature=1.0, seed=123, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=3))
    responses = list(stub.Generate(request, timeout=120))
    prompt = tokenizer.encode(PROMPT)
    sampled = [t for r in responses for t in r.token_ids]
    entries = [e for r in responses for e in r.logprobs]
    prompt_entries = [e for r in responses for e in r.prompt_logprobs]
    assert len(sampled) == len(entries) == 8 and len(prompt_entries) == len(prompt) - 1
    rows = reference.logprobs(prompt + sampled)
    for position, entry in enumerate([*prompt_entries, *entries], start=1):
        row = rows[position - 1]
        assert entry.token_id == (prompt + sampled)[position]
        assert close(entry.logprob, row[entry.token_id].item())
        assert entry.token == tokenizer.decode([entry.token_id])
        assert_top_matches([(t.token_id, t.logprob) for t in entry.top_logprobs], row)
    assert responses[-1].usage.completion_tokens == 8
