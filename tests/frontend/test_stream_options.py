"""stream_options as vLLM reads them: continuous_usage_stats puts usage in
every chunk only together with include_usage; alone it adds nothing."""
from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Say hello to me."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)


def stream(client: openai.OpenAI, api: str, stream_options: dict) -> list:
    if api == "chat":
        return list(client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_tokens=3,
                                                   stream=True, stream_options=stream_options))
    return list(client.completions.create(model="tiny-model", prompt="Say hello", max_tokens=3, stream=True,
                                          stream_options=stream_options))


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_continuous_usage_stats_alone_adds_no_usage(client, api):
    chunks = stream(client, api, {"continuous_usage_stats": True})
    assert chunks and all(chunk.usage is None for chunk in chunks)
    assert all(chunk.choices for chunk in chunks)  # and no usage chunk either


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_continuous_usage_counts_the_tokens_so_far(client, api):
    *chunks, last = stream(client, api, {"include_usage": True, "continuous_usage_stats": True})
    assert last.choices == [] and last.usage.completion_tokens == 3
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 3
    assert all(chunk.usage.prompt_tokens == last.usage.prompt_tokens for chunk in chunks)
