"""`--quantization gguf`: a .gguf model's layers multiplied in their quantized blocks give the
tokens and logprobs of its dequantized run (`--quantization none`), since the kernel multiplies
the very weights the conversion dequantizes (tests/worker/test_gguf_linear.py). In bfloat16 the
decode steps' 4-bit matmuls use the weights unrounded (the dequantized run rounds them to
bfloat16), so there the runs start alike and mostly stay so."""
from __future__ import annotations

import logging

import gguf
import pytest
import torch

from common.config import EngineConfig
from common.errors import ConfigError
from common.sampling_params import SamplingParams
from pagedserve.offline.llm import LLM
from test_model_files import tiny_hf_model, write_gguf
from tiny_models import build_tiny_hf_model
from worker.kernels import cpu_ops
from worker.quantization import resolved_quantization

needs_kernels = pytest.mark.skipif(not cpu_ops.packed_linear_available(torch.float32),
                                   reason="the GGUF kernels need AVX-512 and a compiler")
# Over 64 prompt tokens in all: on AMX CPUs the prefill's matmuls then take the dense route in both
# the gguf and the dequantized run (worker/csrc/gguf_linear.cpp), as they take the kernels elsewhere.
PROMPTS = ["The capital of France is", "def quicksort(arr):\n", "1, 2, 3, 4,",
           "Once upon a time, in a small village at the edge of a great forest, there lived",
           "The committee met on a grey Tuesday morning to discuss the budget for the new library, the"
           " repairs to the old bridge and the plans for the summer festival, which"]


def greedy_runs(llm: LLM, prompts, new_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], [o.outputs[0].cumulative_logprob for o in outputs]


def test_a_gguf_model_defaults_to_gguf_and_others_to_none(tmp_path):
    assert resolved_quantization(EngineConfig(model="smollm2-135m-instruct", device="cpu")) == "gguf"
    assert resolved_quantization(EngineConfig(model="smollm2-135m-instruct", device="cpu",
                                              quantization="none")) == "none"
    build_tiny_hf_model("LlamaForCausalLM", tmp_path)
    assert resolved_quantization(EngineConfig(model=str(tmp_path), device="cpu")) == "none"


def test_gguf_on_a_model_that_is_not_gguf_is_a_config_error(tmp_path):
    build_tiny_hf_model("LlamaForCausalLM", tmp_path)
    with pytest.raises(ConfigError, match="--quantization gguf needs a .gguf model"):
        LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", device="cpu", quantization="gguf")


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_gguf_matches_its_dequantized_run(dtype, caplog):
    if dtype == "bfloat16" and not cpu_ops.packed_linear_available(torch.bfloat16):
        pytest.skip("bfloat16 GGUF matmuls need AVX512-BF16")
    settings = dict(dtype=dtype, device="cpu", kv_cache_memory=128 << 20, enforce_eager=dtype == "float32")
    runs = {}
    for method in ("gguf", "none"):
        with caplog.at_level(logging.INFO, logger="worker"):
            llm = LLM(model="smollm2-135m-instruct", quantization=method, **settings)
        assert f"quantization {method}" in caplog.text
        runs[method] = greedy_runs(llm, PROMPTS, 24)
        del llm
    assert "GGUF quantized matmuls: 120 x Q4_1" in caplog.text  # 30 layers x (qkv, o, gate_up, down)
    if dtype == "float32":
        assert runs["gguf"][0] == runs["none"][0]
        torch.testing.assert_close(torch.tensor(runs["gguf"][1]), torch.tensor(runs["none"][1]), rtol=1e-5,
                                   atol=1e-4)
        return
    # The prefill's matmuls are the dequantized run's bit for bit: the first tokens are the same.
    assert [t[0] for t in runs["gguf"][0]] == [t[0] for t in runs["none"][0]]
    pairs = [(a, b) for x, y in zip(runs["gguf"][0], runs["none"][0]) for a, b in zip(x, y)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.75


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "phi3"])  # phi3: fused attn_qkv and gate/up ffn_up tensors
def test_tiny_q8_0_q4_0_gguf_matches_its_dequantized_run(arch, tmp_path):
    path = str(tmp_path / "tiny-q.gguf")
    write_gguf(path, tiny_hf_model(arch, tied=arch == "llama"), arch,
               matmul_types=(gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0))
    settings = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4, enforce_eager=True,
                    kv_cache_memory=16 << 20, model_cache_dir=str(tmp_path / "cache"))
    prompts = [{"prompt_token_ids": [1, 40, 80, 120, 7]}, {"prompt_token_ids": list(range(3, 60))}]
    quantized = LLM(model=path, **settings)
    assert quantized.worker.quantization == "gguf"
    for packed in (quantized.worker.model.layers[0].qkv_packed, quantized.worker.model.layers[0].gate_up_packed):
        assert packed is not None and packed.dtype == torch.uint8
    got = greedy_runs(quantized, prompts, 16)
    del quantized
    expected = greedy_runs(LLM(model=path, quantization="none", **settings), prompts, 16)
    assert got[0] == expected[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(expected[1]), rtol=1e-5, atol=1e-5)
