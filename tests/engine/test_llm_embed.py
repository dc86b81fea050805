"""LLM.embed on a tiny random decoder equals transformers' final hidden states with the same
pooling (cosine >= 0.9999 in float32), whatever the chunking and prefix-cache hits."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from common.errors import InvalidRequestError
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from pagedserve.offline.llm import LLM
from tiny_models import build_tiny_hf_model

SETTINGS = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", attention_backend="torch",
                block_size=4, seed=0, runner="pooling", enforce_eager=True)


def reference(hf_model, prompt: list[int], pooling: str, normalize: bool, dims: int | None = None) -> torch.Tensor:
    """transformers' last_hidden_state (final norm applied), pooled as sentence-transformers does."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0].float()
    vector = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(0)}[pooling]
    if dims is not None:
        vector = vector[:dims]
    return F.normalize(vector, dim=-1) if normalize else vector


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.choice([1, 5, 13, 30]))] for _ in range(count)]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    return directory, build_tiny_hf_model("LlamaForCausalLM", directory)


def assert_close(got: list[float], want: torch.Tensor) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == want.shape
    assert F.cosine_similarity(got_t, want, dim=0).item() >= 0.9999
    assert torch.allclose(got_t, want, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_embed_equals_transformers_pooling(hf_model, pooling):
    directory, model = hf_model
    # A small token budget chunks the longer prompts over several steps. LAST is the default of a
    # decoder without sentence-transformers files; the others come from --pooler-config.
    overrides = {} if pooling == "LAST" else {"pooler_config": {"pooling_type": pooling}}
    llm = LLM(model=str(directory), max_num_batched_tokens=8, **overrides, **SETTINGS)
    batch = prompts(9)
    shared = batch[3][:] + [7, 8, 9]  # a prefix-cache hit for LAST (its blocks are cached by then)
    outputs = llm.embed(batch + [{"prompt_token_ids": shared}])
    assert [o.prompt_token_ids for o in outputs] == batch + [shared]
    for prompt, out in zip(batch + [shared], outputs):
        assert_close(out.outputs.embedding, reference(model, prompt, pooling, True))
    again = llm.embed([shared], PoolingParams(normalize=False))  # the same prompt again
    assert_close(again[0].outputs.embedding, reference(model, shared, pooling, False))
    if pooling == "LAST":
        assert again[0].num_cached_tokens > 0
    else:
        assert again[0].num_cached_tokens == 0  # MEAN/CLS need every position's hidden state
    stats = llm.scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
    if pooling != "LAST":
        return
    prompt = prompts(1, seed=3)[0]
    out = llm.embed(prompt)[0]  # one prompt as token ids
    assert_close(out.outputs.embedding, reference(model, prompt, "LAST", True))
    assert out.outputs.hidden_size == 64
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        llm.embed([prompt], PoolingParams(dimensions=16))
    assert len(llm.embed([prompt], PoolingParams(dimensions=64))[0].outputs.embedding) == 64
    with pytest.raises(InvalidRequestError, match="does not generate"):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.embed([[]])
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.embed([[5] * 513])
    assert_close(llm.embed([[5] * 512])[0].outputs.embedding, reference(model, [5] * 512, "LAST", True))
    assert not llm.scheduler.has_unfinished_requests()


def test_matryoshka_truncates_then_normalises(tmp_path):
    model = build_tiny_hf_model("LlamaForCausalLM", tmp_path, matryoshka_dimensions=[16, 32])
    llm = LLM(model=str(tmp_path), **SETTINGS)
    prompt = prompts(1, seed=5)[0]
    out = llm.embed([prompt], PoolingParams(dimensions=16))[0]
    assert_close(out.outputs.embedding, reference(model, prompt, "LAST", True, dims=16))
    with pytest.raises(InvalidRequestError, match="one of"):
        llm.embed([prompt], PoolingParams(dimensions=20))


def test_generating_scheduler_refuses_pooling_requests():
    """A generating model's scheduler (no pooler) refuses embeddings, and a pooling one generation."""
    from common.config import EngineConfig
    from common.pooling_params import PoolerInfo
    from common.protocol import EngineRequest
    from scheduler.scheduler import Scheduler

    config = EngineConfig(device="cpu", block_size=4)
    embed = EngineRequest(request_id="e", prompt_token_ids=[3, 4], sampling_params=SamplingParams(max_tokens=1),
                          pooling_params=PoolingParams())
    with pytest.raises(InvalidRequestError, match="does not serve embeddings"):
        Scheduler(config, num_blocks=16, max_model_len=32, eos_token_ids=[0]).add_request(embed)
    pooling = Scheduler(config, num_blocks=16, max_model_len=32, eos_token_ids=[0],
                        pooler=PoolerInfo(pooling_type="MEAN", normalize=True, hidden_size=8))
    with pytest.raises(InvalidRequestError, match="does not generate"):
        pooling.add_request(EngineRequest(request_id="g", prompt_token_ids=[3], sampling_params=SamplingParams()))
    pooling.add_request(embed)
    plan = pooling.schedule()
    assert plan.new_requests[0].pooling_params == PoolingParams(normalize=True, pooling_type="MEAN")
