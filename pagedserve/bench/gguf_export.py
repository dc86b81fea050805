"""Write a llama-architecture Hugging Face model as a float32 GGUF file.

The reverse of common/gguf_convert.py: tensors renamed to llama.cpp's names,
q/k rows permuted as llama.cpp's convert_hf_to_gguf does (the rotary pairs
interleaved), shape metadata from config.json, and the tokenizer metadata
(`tokenizer.*`: vocabulary, merges, special ids, chat template) copied from
a GGUF file that has the same tokenizer. The result loads in pagedserve and
in llama.cpp, whose quantizer makes the Q8_0 / Q4_K / ... files from it
(`pagedserve bench make-gguf`).
"""
from __future__ import annotations

import json
import os

import numpy as np

from common.errors import ConfigError
from common.gguf_convert import _GLOBAL_TENSORS, _LAYER_TENSORS

_GGUF_GLOBAL = {hf: gguf for gguf, hf in _GLOBAL_TENSORS.items()}
_GGUF_LAYER = {hf: gguf for gguf, hf in _LAYER_TENSORS.items()}


def gguf_tensor_name(hf_name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`."""
    stem, _, kind = hf_name.rpartition(".")
    if stem in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[stem]}.{kind}"
    parts = stem.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _GGUF_LAYER:
        return f"blk.{parts[2]}.{_GGUF_LAYER[parts[3]]}.{kind}"
    raise ConfigError(f"tensor {hf_name!r} has no llama.cpp name in this exporter")


def permute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute`: each head's rows viewed as
    (2, dim/2) and transposed (common.gguf_convert.unpermute_rotary_rows undoes it)."""
    half = weight.shape[0] // num_heads // 2
    return (weight.reshape(num_heads, 2, half, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape))


def _hf_tensors(model_dir: str):
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} holds no .safetensors weights")
    for name in files:
        with safe_open(os.path.join(model_dir, name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key).float().numpy()


def _copy_tokenizer_fields(writer, tokenizer_gguf: str) -> None:
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(tokenizer_gguf)
    copied = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = GGUFValueType(field.types[0])
        sub_type = GGUFValueType(field.types[-1]) if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type)
        copied += 1
    if not copied:
        raise ConfigError(f"{tokenizer_gguf} has no tokenizer metadata to copy")


def write_f32_gguf(model_dir: str, out_path: str, tokenizer_gguf: str, name: str | None = None) -> str:
    """Write the HF llama model in `model_dir` to `out_path` (float32 tensors); returns out_path."""
    from gguf import GGUFWriter, LlamaFileType

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    if config.get("model_type") != "llama":
        raise ConfigError(f"{model_dir}: only llama-architecture models are exported, got {config.get('model_type')!r}")
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    if config.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise ConfigError(f"{model_dir}: rope scaling is not exported")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    writer = GGUFWriter(out_path, "llama")
    writer.add_name(name or os.path.basename(os.path.normpath(model_dir)))
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_vocab_size(config["vocab_size"])
    _copy_tokenizer_fields(writer, tokenizer_gguf)
    for hf_name, weight in _hf_tensors(model_dir):
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # tied: llama.cpp reads the embedding when there is no output tensor
        gguf_name = gguf_tensor_name(hf_name)
        part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if part == "attn_q":
            weight = permute_rotary_rows(weight, heads)
        elif part == "attn_k":
            weight = permute_rotary_rows(weight, kv_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(weight, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
