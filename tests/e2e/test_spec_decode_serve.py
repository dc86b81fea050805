"""Speculative decoding as a user runs it: `pagedserve serve --speculative-config` (the real
process split, SmolLM2 in float32) answers copy tasks through the openai client exactly as
the engine does without speculation, streams several tokens per step, and reports the
spec-decode metrics; tiny Llama and Qwen2 models served with a draft model (a perturbed
copy), and the offline LLM on SmolLM2 with a draft model (a tiny random Llama with its
vocabulary), give the tokens plain decoding gives too; a bad config is a usage error."""
from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from common.sampling_params import SamplingParams
from pagedserve.bench.copy_workload import copy_tasks
from serve_helpers import MODEL, metric_samples, running_server
from tiny_models import build_tiny_llama_with_smollm2_tokenizer, save_perturbed

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("serve-spec"), [
            "--enforce-eager", "--disable-log-stats", "--speculative-config", json.dumps(NGRAM)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain_llm():
    from pagedserve.offline.llm import LLM
    return LLM(model=MODEL, dtype="float32", kv_cache_memory=1 << 29, enforce_eager=True)


def messages(index: int) -> list[dict]:
    return [{"role": "user", "content": copy_tasks()[index][0]}]


def test_served_greedy_outputs_equal_the_engine_without_speculation(spec_server, plain_llm):
    client = openai.OpenAI(base_url=spec_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for index in (0, 1):
        expected = plain_llm.chat(messages(index), params, use_tqdm=False)[0].outputs[0].text
        reply = client.chat.completions.create(model=MODEL, messages=messages(index), temperature=0,
                                               max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == expected
        assert reply.usage.completion_tokens == MAX_TOKENS
    # Streamed: steps that accept drafts send several tokens in one chunk; the text is the same.
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages(0), temperature=0, max_tokens=MAX_TOKENS, stream=True,
        extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain_llm.chat(messages(0), params, use_tqdm=False)[0].outputs[0].text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) < MAX_TOKENS
    samples = metric_samples(spec_server)
    drafts = samples["pagedserve:spec_decode_num_draft_tokens_total"]
    accepted = samples["pagedserve:spec_decode_num_accepted_tokens_total"]
    assert samples["pagedserve:spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafts
    assert samples["pagedserve:spec_decode_num_accepted_tokens_per_pos_total"] == accepted


def tiny_with_smollm2_tokenizer(architecture: str, directory):
    """A tiny random model of `architecture` that reads and writes text with SmolLM2's tokenizer."""
    import shutil

    from common.model_files import resolve_model_dir
    from tiny_models import build_tiny_hf_model
    if architecture == "LlamaForCausalLM":
        return build_tiny_llama_with_smollm2_tokenizer(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{resolve_model_dir(MODEL)}/{name}", directory / name)
    return build_tiny_hf_model(architecture, directory, vocab_size=49152, eos_token_id=2, bos_token_id=1,
                               tie_word_embeddings=True)


@pytest.fixture(scope="module", params=["LlamaForCausalLM", pytest.param("Qwen2ForCausalLM", marks=pytest.mark.slow)])
def tiny_pair(request, tmp_path_factory):
    """A tiny random model with SmolLM2's tokenizer, and a draft: the same model with its
    weights perturbed (it agrees often, not always)."""
    target, draft = tmp_path_factory.mktemp("tiny-target"), tmp_path_factory.mktemp("tiny-draft")
    tiny_with_smollm2_tokenizer(request.param, target)
    save_perturbed(tiny_with_smollm2_tokenizer(request.param, draft), draft, 0.05)
    return target, draft


def test_served_tiny_models_with_a_draft_model_equal_plain_decoding(tmp_path, tiny_pair):
    from pagedserve.offline.llm import LLM
    target, draft = tiny_pair
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    prompts = ["The capital of France is", "def fibonacci(n):", "one two three one two three one"]
    plain = LLM(model=str(target), dtype="float32", kv_cache_memory=1 << 27, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = [o.outputs[0].text for o in plain.generate(prompts, params, use_tqdm=False)]
    with running_server(tmp_path, ["--model", str(target), "--enforce-eager", "--disable-log-stats",
                                   "--kv-cache-memory", "128MiB", "--speculative-config", json.dumps(spec)]) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt, text in zip(prompts, expected):
            reply = client.completions.create(model=str(target), prompt=prompt, temperature=0, max_tokens=32,
                                              extra_body={"ignore_eos": True})
            assert reply.choices[0].text == text
        samples = metric_samples(server)
    assert 0 < samples["pagedserve:spec_decode_num_accepted_tokens_total"] < samples[
        "pagedserve:spec_decode_num_draft_tokens_total"]


def test_offline_draft_model_equals_plain_decoding(tmp_path, plain_llm):
    from pagedserve.offline.llm import LLM
    build_tiny_llama_with_smollm2_tokenizer(tmp_path)
    llm = LLM(model=MODEL, dtype="float32", kv_cache_memory=1 << 29, enforce_eager=True,
              speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [messages(i) for i in range(3)]
    assert ([o.outputs[0].token_ids for o in llm.chat(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in plain_llm.chat(prompts, params, use_tqdm=False)])
    assert llm.scheduler.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("setting, message", [
    ('{"method": "ngram"', "not valid JSON"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
])
def test_a_bad_speculative_config_is_a_usage_error(setting, message):
    done = subprocess.run([sys.executable, "-m", "pagedserve.cli", "generate", "--speculative-config", setting,
                           "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr
