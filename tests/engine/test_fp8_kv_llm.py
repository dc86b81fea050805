"""--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2 through the offline engine: the greedy tokens of
transformers with K/V rounded the same way, twice the blocks of a 16-bit cache in the same
memory, and chunked prefill, prefix caching and preemption leaving no block behind."""
from __future__ import annotations

import random

import pytest
import torch

from common.sampling_params import SamplingParams
from tiny_models import build_tiny_hf_model, hf_greedy
from pagedserve.offline.llm import LLM

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-fp8")
    return build_tiny_hf_model("LlamaForCausalLM", directory), directory


def prompts(count: int, seed: int) -> list[list[int]]:
    """Some pairs share a 12-token prefix (3 blocks of 4): prefix-cache hits."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(12)]
    return [(shared if i % 3 == 0 else []) + [rng.randrange(3, 256) for _ in range(rng.randint(1, 40))]
            for i in range(count)]


def generate_ids(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_no_leaked_blocks(llm: LLM) -> None:
    stats = llm.scheduler.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for p, q in zip(a, b) for x, y in zip(p, q)]
    assert len(pairs) == sum(map(len, a))
    return sum(x == y for x, y in pairs) / len(pairs)


def fp8_rounded_kv_attention(dtype: torch.dtype, scales: dict[int, tuple[float, float]] | None = None):
    """transformers' SDPA attention over K/V rounded through the 8-bit format (divided by the layer's
    scales, saturated, rounded, multiplied back): what attention over an 8-bit cache computes,
    independently of our cache and kernels. Without checkpoint scales, queries and keys are first
    rotated by the same Hadamard matrix (scores unchanged; the cache holds rotated keys)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    largest = torch.finfo(dtype).max

    def attention(module, query, key, value, *args, **kwargs):
        layer_scales = (scales or {}).get(module.layer_idx, (1.0, 1.0))
        if scales is None:
            rotation = hadamard_matrix(query.shape[-1])
            query, key = ((t.float() @ rotation).to(t.dtype) for t in (query, key))
        key, value = ((t.float() / s).clamp(-largest, largest).to(dtype).float().mul(s).to(query.dtype)
                      for t, s in zip((key, value), layer_scales))
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)
    return attention


def hadamard_matrix(dim: int) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix (dim a power of two), built by scipy."""
    from scipy.linalg import hadamard

    return torch.tensor(hadamard(dim), dtype=torch.float32) / dim ** 0.5


def rounded_greedy(hf_model, batch: list[list[int]], dtype: torch.dtype,
                   scales: dict[int, tuple[float, float]] | None = None) -> list[list[int]]:
    from transformers import AttentionInterface

    name = f"rounded_{dtype}_{sorted((scales or {}).items())}"
    AttentionInterface.register(name, fp8_rounded_kv_attention(dtype, scales))
    hf_model.set_attn_implementation(name)
    try:
        return [hf_greedy(hf_model, p, NEW_TOKENS) for p in batch]
    finally:
        hf_model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("kv_cache_dtype,cache_dtype", [("fp8", torch.float8_e4m3fn),
                                                        ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_greedy_equals_transformers_over_rounded_kv(tiny_llama, kv_cache_dtype, cache_dtype):
    """Compiled, chunked prefill (a 24-token budget), prefix-cache hits: the tokens of transformers
    with the same rounding of K/V. The full-precision cache's tokens differ (tiny random weights
    have near ties the rounding flips), so the check is not vacuous."""
    hf_model, directory = tiny_llama
    batch = prompts(12, seed=1)
    expected = rounded_greedy(hf_model, batch, cache_dtype)
    assert expected != [hf_greedy(hf_model, p, NEW_TOKENS) for p in batch]
    llm = LLM(model=str(directory), dtype="float32", kv_cache_dtype=kv_cache_dtype, block_size=4,
              max_num_batched_tokens=24, num_gpu_blocks_override=512, skip_tokenizer_init=True)
    assert llm.worker.forward.compiled
    assert {c.dtype for pair in llm.worker.kv_caches for c in pair} == {cache_dtype}
    assert llm.worker.kv_scales == [(1.0, 1.0)] * len(llm.worker.kv_caches)
    assert generate_ids(llm, batch) == expected
    assert llm.scheduler.stats().prefix_cache_hits > 0
    assert_no_leaked_blocks(llm)


def test_fp8_cache_preemption_recomputes_the_same_tokens(tiny_llama):
    _, directory = tiny_llama
    batch = prompts(8, seed=2)
    roomy = LLM(model=str(directory), dtype="float32", kv_cache_dtype="fp8", block_size=4, enforce_eager=True,
                num_gpu_blocks_override=512, skip_tokenizer_init=True)
    expected = generate_ids(roomy, batch)
    assert roomy.scheduler.stats().num_preemptions == 0
    tight = LLM(model=str(directory), dtype="float32", kv_cache_dtype="fp8", block_size=4, enforce_eager=True,
                num_gpu_blocks_override=25, max_model_len=76, skip_tokenizer_init=True)
    assert generate_ids(tight, batch) == expected
    assert tight.scheduler.stats().num_preemptions > 0
    assert_no_leaked_blocks(tight)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fp8_cache_under_16bit_models(tiny_llama, dtype):
    """bfloat16 and float16 models over an 8-bit cache: compiled and eager agree on the tokens."""
    _, directory = tiny_llama
    batch = prompts(8, seed=3)

    def engine(**kwargs) -> LLM:
        return LLM(model=str(directory), dtype=dtype, kv_cache_dtype="fp8", block_size=4, max_num_batched_tokens=24,
                   num_gpu_blocks_override=512, skip_tokenizer_init=True, **kwargs)

    compiled = engine()
    ours = generate_ids(compiled, batch)
    assert_no_leaked_blocks(compiled)
    assert agreement(generate_ids(engine(enforce_eager=True), batch), ours) >= 0.97


def test_fp8_cache_holds_twice_the_tokens_of_bfloat16(tiny_llama):
    _, directory = tiny_llama
    memory = 3 << 20

    def blocks(**kwargs) -> tuple[int, int]:
        llm = LLM(model=str(directory), dtype="bfloat16", kv_cache_memory=memory, enforce_eager=True,
                  skip_tokenizer_init=True, **kwargs)
        return llm.worker.num_blocks, llm.config.block_size

    bf16_blocks, bf16_block_size = blocks()
    fp8_blocks, fp8_block_size = blocks(kv_cache_dtype="fp8_e4m3")
    assert fp8_block_size == 2 * bf16_block_size  # blocks of the same bytes
    assert fp8_blocks == bf16_blocks
    assert blocks(kv_cache_dtype="fp8", block_size=16)[0] == 2 * blocks(block_size=16)[0]


def test_checkpoint_kv_scales_are_read_and_used(tmp_path):
    """vLLM's checkpoint names (self_attn.k_scale, self_attn.v_proj.output_scale, ...): the weights
    load past them, the cache uses them, and the tokens are transformers' over K/V rounded with them."""
    from safetensors.torch import load_file, save_file

    hf_model = build_tiny_hf_model("LlamaForCausalLM", tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.02)
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([0.03])
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(0.5)  # both, but v_proj names V
    save_file(tensors, path, metadata={"format": "pt"})
    scales = {0: (0.02, 1.0), 1: (0.5, 0.03)}
    batch = prompts(6, seed=4)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp8_e4m3", block_size=4, enforce_eager=True,
              num_gpu_blocks_override=256, skip_tokenizer_init=True)
    assert [tuple(round(x, 6) for x in pair) for pair in llm.worker.kv_scales] == [scales[0], scales[1]]
    expected = rounded_greedy(hf_model, batch, torch.float8_e4m3fn, scales)
    assert expected != rounded_greedy(hf_model, batch, torch.float8_e4m3fn)
    assert generate_ids(llm, batch) == expected
    unscaled = LLM(model=str(tmp_path), dtype="float32", enforce_eager=True, num_gpu_blocks_override=256,
                   skip_tokenizer_init=True)
    assert unscaled.worker.kv_scales is None  # a 16/32-bit cache ignores them

    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([0.5, 0.5])
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="only per-tensor scales"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="fp8", enforce_eager=True,
            num_gpu_blocks_override=256, skip_tokenizer_init=True)
