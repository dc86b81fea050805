"""The frontend's per-sample decoding without a server: interleaved samples,
a stop string ending one sample, logprobs kept for the counted tokens only,
best_of ranking, and the logprobs shapes of the APIs."""
from __future__ import annotations

import pytest

from common.protocol import FinishReason, RequestOutput, TokenLogprobs
from common.sampling_params import SamplingParams
from common.sample_choices import SampleResult, best_samples
from frontend.engine.generation import _SampleStreams
from frontend.engine.generation_request import GenerationRequest
from frontend.engine.token_texts import TokenTexts
from frontend.openai.logprobs_format import MIN_LOGPROB, chat_logprobs, completion_logprobs, prompt_logprobs_json
from common.output_decoder import DecodedDelta
from tests.frontend.conftest import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from common.tokenizer import load_tokenizer
    return load_tokenizer(str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


def entry(token_id: int, logprob: float = -1.0) -> TokenLogprobs:
    return TokenLogprobs(token_id, logprob, 1, [token_id], [logprob])


def output(index: int, token_ids: list[int], finish: FinishReason | None = None, more: bool = False,
           **fields) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=token_ids, finish_reason=finish, index=index,
                         more_samples=more, num_prompt_tokens=3, logprobs=[entry(t) for t in token_ids], **fields)


def test_a_stop_string_ends_one_sample_and_asks_to_abort_it(tokenizer):
    ids = tokenizer.encode(" Hello, world! How are you")
    params = SamplingParams(n=2, stop=["world"], logprobs=0)
    streams = _SampleStreams(tokenizer, GenerationRequest("r", [1, 2, 3], params))
    first = streams.add(output(0, ids[:1], prompt_logprobs=[entry(2), entry(3)]))
    assert first[0].prompt_logprobs is not None and first[0].index == 0
    deltas = streams.add(output(1, ids))
    [delta] = deltas
    assert (delta.index, delta.finish_reason, delta.stop_reason, delta.text) == (1, "stop", "world", " Hello, ")
    stop_at = next(k for k in range(1, len(ids) + 1) if "world" in tokenizer.decode(ids[:k]))
    assert delta.token_ids == ids[:stop_at] and len(delta.logprobs) == stop_at  # nothing after the stop string
    assert streams.take_stopped_samples() == [1] and not delta.request_finished
    assert streams.add(output(1, ids[:1])) == []  # a late output of the stopped sample is ignored
    [last] = streams.add(output(0, ids[1:2], FinishReason.LENGTH))
    assert last.request_finished and last.finish_reason == "length"
    assert last.num_output_tokens == 2 + stop_at


def test_samples_the_scheduler_never_started_end_as_aborted(tokenizer):
    streams = _SampleStreams(tokenizer, GenerationRequest("r", [1], SamplingParams(n=3)))
    deltas = streams.add(output(0, [], FinishReason.ABORT))  # aborted before the fork: nothing more comes
    assert [(d.index, d.finish_reason) for d in deltas] == [(0, "abort"), (1, "abort"), (2, "abort")]
    assert [d.request_finished for d in deltas] == [False, False, True]


def test_best_samples_ranks_by_cumulative_logprob_only_with_best_of():
    samples = [SampleResult(i) for i in range(4)]
    for sample, logprob in zip(samples, [-3.0, -1.0, -5.0, -2.0]):
        sample.add(DecodedDelta([1, 2], "x", [entry(1, logprob / 2), entry(2, logprob / 2)], "length"))
    assert [s.index for s in best_samples(samples, 2)] == [1, 3]
    assert [s.index for s in best_samples(list(reversed(samples)), 4)] == [0, 1, 2, 3]


def test_logprobs_shapes(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("Hello, world! How")
    assert len(ids) >= 3
    entries = [TokenLogprobs(ids[1], -0.5, 2, [7, ids[1]], [-0.25, -0.5]), TokenLogprobs(ids[2], float("-inf"), 9)]
    legacy = completion_logprobs(ids[:3], [None, *entries], texts, text_offset=4)
    assert legacy.tokens == [texts.text(t) for t in ids[:3]]
    assert legacy.token_logprobs == [None, -0.5, MIN_LOGPROB]  # -inf is not JSON
    assert legacy.top_logprobs[0] is None and legacy.top_logprobs[1] == {texts.text(7): -0.25, texts.text(ids[1]): -0.5}
    assert legacy.text_offset == [4, 4 + len(legacy.tokens[0]), 4 + len(legacy.tokens[0]) + len(legacy.tokens[1])]
    chat = chat_logprobs(entries[:1], texts).content[0]
    assert (chat.token, chat.logprob, [t.logprob for t in chat.top_logprobs]) == (texts.text(ids[1]), -0.5,
                                                                                    [-0.25, -0.5])
    assert bytes(chat.bytes).decode() == chat.token
    prompt = prompt_logprobs_json(entries[:1], texts)
    assert prompt[0] is None
    assert prompt[1] == {"7": {"logprob": -0.25, "rank": 1, "decoded_token": texts.text(7)},
                         str(ids[1]): {"logprob": -0.5, "rank": 2, "decoded_token": texts.text(ids[1])}}


def test_token_bytes_are_exact_for_pieces_of_a_character(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("日本語 🙂")
    pieces = [texts.bytes(t) for t in ids]
    assert b"".join(bytes(p) for p in pieces) == "日本語 🙂".encode()
    assert any(texts.text(t).endswith("\ufffd") for t in ids)  # some token holds part of a character
