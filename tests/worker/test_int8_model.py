"""`--quantization int8` end to end: a tiny random Llama through the engine gives the greedy
tokens of the plain-PyTorch W8A8 path (the same int8 values and scales, products exact in
int32) and stays close to the float model; a compressed-tensors W8A8 checkpoint of the same
model loads to the same outputs; bad combinations are refused; the default model still talks."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import cpu_flags
from common.errors import ConfigError
from pagedserve.bench.fast_path_check import first_step_logits, greedy_tokens, relative_l2
from pagedserve.bench.workloads import NAMED_WORKLOADS, BenchRequest, generate_workload
from pagedserve.offline.llm import LLM
from tiny_models import build_tiny_hf_model
from worker.kernels import int8_ops
from worker.quantization import int8_weights
from worker.quantization.int8_weights import Int8Linear

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
W8A8_CONFIG = {  # compressed-tensors' W8A8 preset as llm-compressor writes it into config.json
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None, "format": None,
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "channel",
                    "dynamic": False, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None,
                              "strategy": "token", "dynamic": True, "observer": None}}},
}

# Without VNNI the int8 layers run in plain PyTorch (torch._int_mm, ~20x slower than float32).
needs_vnni = pytest.mark.skipif("avx512_vnni" not in cpu_flags(), reason="no AVX512-VNNI int8 kernel on this CPU")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("int8-llama")
    build_tiny_hf_model("LlamaForCausalLM", directory, attention_bias=True, mlp_bias=True)
    return directory


def tiny_requests(count: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(256) for _ in range(rng.randint(1, 50))], 16) for _ in range(count)]


def engine(directory, dtype: str, eager: bool = False, **kwargs) -> LLM:
    return LLM(model=str(directory), dtype=dtype, enforce_eager=eager, block_size=4, num_gpu_blocks_override=512,
               skip_tokenizer_init=True, **kwargs)


def int8_layers(llm: LLM) -> list[Int8Linear]:
    return [getattr(layer, name + "_packed") for layer in llm.worker.model.layers
            for name in int8_weights.LAYER_WEIGHTS]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_engine_is_the_plain_w8a8_model(tiny_llama, dtype, monkeypatch):
    requests = tiny_requests(8)
    quantized = engine(tiny_llama, dtype, quantization="int8")
    assert quantized.worker.quantization == "int8"
    layers = int8_layers(quantized)
    assert all(isinstance(layer, Int8Linear) for layer in layers)
    assert all(getattr(layer, name + "_weight").numel() == 0  # the float weights are freed
               for layer in quantized.worker.model.layers for name in int8_weights.LAYER_WEIGHTS)
    assert all(layer.use_kernel == int8_ops.int8_linear_available() for layer in layers)
    tokens = greedy_tokens(quantized, requests)
    logits = first_step_logits(quantized, requests)
    # The reference: the same engine with the int8 matmuls in plain PyTorch, eager.
    monkeypatch.setattr(int8_ops, "int8_linear_available", lambda: False)
    plain = engine(tiny_llama, dtype, eager=True, quantization="int8")
    assert not any(layer.use_kernel for layer in int8_layers(plain))
    assert greedy_tokens(plain, requests) == tokens
    plain_logits = first_step_logits(plain, requests)
    assert relative_l2(logits, plain_logits) < (1e-5 if dtype == "float32" else 1e-2)
    monkeypatch.undo()
    # Close to the float model, but not it.
    float_logits = first_step_logits(engine(tiny_llama, dtype), requests)
    assert 1e-4 < relative_l2(logits, float_logits) < 0.1
    assert (logits.argmax(-1) == float_logits.argmax(-1)).float().mean() >= 0.75


# The graph holds the kernel's custom ops (their fakes registered by int8_ops); without VNNI it is
# plain PyTorch, whose graph reuse test_fast_path checks, at two minutes of compiling here.
@needs_vnni
def test_one_int8_graph_serves_every_group_and_batch(tmp_path):
    """Twelve layers in two compiled groups of six: the graphs for one token and for more serve
    both groups and every batch."""
    build_tiny_hf_model("LlamaForCausalLM", tmp_path, num_hidden_layers=12)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    llm = engine(tmp_path, "bfloat16", quantization="int8", max_num_batched_tokens=33)
    assert llm.worker.forward.compiled and llm.worker.forward.group_size == 6
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 2
    greedy_tokens(llm, tiny_requests(1, seed=2))  # single-token decode steps
    greedy_tokens(llm, tiny_requests(12, seed=3))  # chunked prefills among decodes
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 2


def write_compressed_checkpoint(float_dir, out_dir, dtype: torch.dtype = torch.float32) -> None:
    """The float checkpoint (its weights rounded to `dtype`) in compressed-tensors W8A8: each
    decoder projection's weight as int8 with weight_scale [N, 1] (the format's symmetric channel
    scales: max|row| / 127), the rest as is."""
    tensors = load_file(str(float_dir / "model.safetensors"))
    out = {}
    for name, tensor in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.split(".", 3)[-1] in PROJECTIONS:
            weight = tensor.to(dtype).float()
            scale = weight.abs().amax(dim=1, keepdim=True) / 127
            out[name] = torch.round(weight / scale).clamp(-128, 127).to(torch.int8)
            out[module + ".weight_scale"] = scale
        else:
            out[name] = tensor
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = W8A8_CONFIG
    (out_dir / "config.json").write_text(json.dumps(config))
    for extra in float_dir.iterdir():
        if not (out_dir / extra.name).exists():
            (out_dir / extra.name).write_bytes(extra.read_bytes())


def test_the_checkpoint_is_what_compressed_tensors_reads(tiny_llama, tmp_path):
    """Checked against the format's own package where it is installed: the config parses as a
    W8A8 int-quantized scheme and its decompressor gives back the float weights to the scales."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    write_compressed_checkpoint(tiny_llama, tmp_path)
    config = QuantizationConfig.model_validate(json.loads((tmp_path / "config.json").read_text())["quantization_config"])
    scheme = config.config_groups["group_0"]
    preset = preset_name_to_scheme("W8A8", ["Linear"])
    assert (scheme.weights.strategy, scheme.input_activations.strategy) == (preset.weights.strategy, "token")
    assert scheme.input_activations.dynamic is True and config.format == "int-quantized"
    compressed, original = load_file(str(tmp_path / "model.safetensors")), load_file(str(tiny_llama / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    state = {"weight": compressed[name + ".weight"], "weight_scale": compressed[name + ".weight_scale"]}
    assert isinstance(ct.__version__, str)
    dense = IntQuantizationCompressor.decompress(state, scheme)["weight"]
    assert torch.allclose(dense.float(), original[name + ".weight"], atol=float(state["weight_scale"].max()) / 2 + 1e-7)
    # And its compressor makes the same int8 values from the float weight and these scales.
    recompressed = IntQuantizationCompressor.compress({"weight": original[name + ".weight"],
                                                       "weight_scale": state["weight_scale"]}, scheme)
    assert torch.equal(recompressed["weight"], state["weight"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compressed_tensors_checkpoint_loads_as_int8(tiny_llama, tmp_path, dtype):
    write_compressed_checkpoint(tiny_llama, tmp_path, getattr(torch, dtype))
    requests = tiny_requests(6, seed=1)
    loaded = engine(tmp_path, dtype)  # --quantization unset: int8 from the checkpoint
    assert loaded.worker.quantization == "int8"
    at_load = engine(tiny_llama, dtype, quantization="int8")
    for a, b in zip(int8_layers(loaded), int8_layers(at_load)):
        assert torch.equal(a.scale, b.scale)
        assert torch.equal(*(x.packed if x.use_kernel else x.q for x in (a, b)))
    assert torch.equal(first_step_logits(loaded, requests), first_step_logits(at_load, requests))
    assert greedy_tokens(loaded, requests) == greedy_tokens(at_load, requests)
    assert engine(tmp_path, dtype, quantization="int8").worker.quantization == "int8"


def test_bad_combinations_are_refused(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match="float16"):
        engine(tiny_llama, "float16", quantization="int8")
    write_compressed_checkpoint(tiny_llama, tmp_path)
    with pytest.raises(ConfigError, match="compressed-tensors"):
        engine(tmp_path, "float32", quantization="none")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="weights"):
        engine(tmp_path, "float32")
    config["quantization_config"]["quant_method"] = "awq"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="awq"):
        engine(tmp_path, "float32")


# 13 minutes without VNNI; the plain path is checked on the tiny model above, this checks the
# scheme on a real model.
@needs_vnni
def test_default_model_int8_first_tokens_follow_bf16():
    """SmolLM2-135M in W8A8: most first greedy tokens of W1's prompts are bf16's, and the text reads."""
    requests = [BenchRequest(r.prompt_token_ids, 1)
                for r in generate_workload(NAMED_WORKLOADS["W1"], vocab_size=49152)[:16]]
    int8 = LLM(dtype="bfloat16", quantization="int8", kv_cache_memory=256 << 20)
    bf16 = LLM(dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory=256 << 20)
    first_int8 = [t[0] for t in greedy_tokens(int8, requests)]
    first_bf16 = [t[0] for t in greedy_tokens(bf16, requests)]
    assert sum(a == b for a, b in zip(first_int8, first_bf16)) / len(requests) >= 0.75
    from pagedserve.bench.throughput import greedy_params
    text = int8.generate(["The capital of France is"], greedy_params(8), use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text
