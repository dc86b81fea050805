"""The gRPC API exposes the same controls and outputs as the HTTP API:
samples with indexes, seeds, stop strings, echo, best_of and usage."""
from __future__ import annotations

from collections import defaultdict

from common.grpc_gen import pagedserve_pb2 as pb
from serve_helpers import MODEL


def generate(stub, **fields) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=120))


def by_sample(responses: list[pb.GenerateResponse]) -> dict[int, list[pb.GenerateResponse]]:
    grouped = defaultdict(list)
    for response in responses:
        grouped[response.index].append(response)
    return dict(grouped)


def test_samples_stream_with_their_index_and_match_the_http_api(stub, client):
    params = dict(temperature=1.0, seed=5, max_tokens=5, ignore_eos=True)
    responses = generate(stub, text="The sea is", sampling_params=pb.SamplingParams(n=3, **params))
    samples = by_sample(responses)
    assert set(samples) == {0, 1, 2}
    for messages in samples.values():
        assert sum(len(m.token_ids) for m in messages) == 5
        assert [m.finish_reason for m in messages][-1] == pb.FINISH_REASON_LENGTH
    assert [r.HasField("usage") for r in responses] == [False] * (len(responses) - 1) + [True]
    assert responses[-1].usage.completion_tokens == 15
    http = client.completions.create(model=MODEL, prompt="The sea is", n=3, temperature=1.0, seed=5, max_tokens=5,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in http.choices] == ["".join(m.text for m in samples[i]) for i in range(3)]
    assert responses[-1].usage.prompt_tokens == http.usage.prompt_tokens


def test_stop_string_echo_and_best_of(stub):
    full = "".join(r.text for r in generate(stub, text="The capital of France is",
                                            sampling_params=pb.SamplingParams(temperature=0, max_tokens=8)))
    stop = full.strip().split()[1][:3]
    responses = generate(stub, text="The capital of France is", echo=True, sampling_params=pb.SamplingParams(
        temperature=0, max_tokens=8, stop=[stop], include_stop_str_in_output=True))
    text = "".join(r.text for r in responses)
    assert text == "The capital of France is" + full[:full.index(stop) + len(stop)]
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP and responses[-1].stop_str == stop
    best = generate(stub, text="Hello", sampling_params=pb.SamplingParams(
        n=2, best_of=3, temperature=1.0, seed=2, max_tokens=3, ignore_eos=True))
    assert [r.index for r in best] == [0, 1] and all(not r.logprobs for r in best)
    assert best[-1].usage.completion_tokens == 9  # every generated sample counts


def test_chat_messages_with_tools_and_template_kwargs(stub, tokenizer):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="system", content="Be brief."),
                                     pb.ChatMessage(role="user", content="Weather?"),
                                     pb.ChatMessage(role="tool", content="sunny", tool_call_id="c1")])
    chat.chat_template_kwargs.update({"unused": True})
    responses = generate(stub, chat=chat, sampling_params=pb.SamplingParams(temperature=0, max_tokens=2))
    assert responses[-1].usage.completion_tokens == 2
