"""Convert a GGUF file (llama, mistral-style, qwen2, qwen3, phi3; gemma2, gemma3 and the
MoE ones, Mixtral, qwen2moe, qwen3moe, by the rules of common/gguf_arch_rules.py) into a plain
Hugging Face model directory: config.json, float32 safetensors, tokenizer
files and generation_config.json.

The directory is built in a temporary sibling and renamed into place, so a
crash never leaves a half-written model behind. No torch at module level:
numpy + gguf + safetensors.numpy do the tensor work.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

import numpy as np

from common import gguf_arch_rules as rules
from common.errors import ConfigError

logger = logging.getLogger(__name__)

# Bumped whenever the output of the conversion changes, so caches keyed on it
# are rebuilt instead of silently reused.
CONVERTER_VERSION = 2
MARKER_FILE = "pagedserve_conversion.json"
DEFAULT_MAX_SHARD_BYTES = 4 << 30

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                           **{v: cls for v, (cls, _) in rules.VARIANTS.items() if v != "mixtral"}}

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q, k and v rows in one tensor, as HF stores them
}
# phi3's ffn_up holds the gate rows then the up rows: HF Phi3's fused gate_up_proj.
_ARCH_LAYER_TENSORS = {"phi3": {"ffn_up": "mlp.gate_up_proj"}}
# phi3's LongRoPE factors: rope parameters of the config, not weights.
ROPE_FACTOR_TENSORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_NAME = re.compile(r"(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; `arch`: the variant
    (gguf_arch_rules.variant_of). Stacked experts get an "{e}" placeholder for the expert index."""
    if m := _LAYER_NAME.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        names = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(arch, {}), **rules.LAYER_TENSORS.get(arch, {}),
                 **rules.EXPERT_TENSORS.get(arch, {})}
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
    elif (m := _GLOBAL_NAME.fullmatch(gguf_name)) and m.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    hint = " (Llama-3 style rope scaling is not supported)" if gguf_name.startswith("rope_freqs") else ""
    raise ConfigError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in this converter{hint}")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute`, which reorders each
    head's q/k rows (weights and biases) from HF's half-split rotary layout
    to interleaved pairs: it views a head's rows as (2, dim/2) and transposes;
    we view them as (dim/2, 2) and transpose back."""
    half = weight.shape[0] // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape))


def _shortest_float(value: float) -> float:
    """GGUF stores float32; 9.999999747e-06 reads back as the 1e-05 it was."""
    return float(str(np.float32(value)))


class GGUFModel:
    """The metadata and tensors of one GGUF file, with HF-oriented accessors."""

    def __init__(self, path: str):
        from gguf import GGUFReader

        self.path = path
        try:
            self.reader = GGUFReader(path)
        except Exception as exc:  # gguf raises ValueError/struct errors on junk input
            raise ConfigError(f"{path} is not a readable GGUF file: {exc}") from exc
        self.arch = self.field("general.architecture")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"GGUF architecture {self.arch!r} in {path} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)} (llama with experts: Mixtral)")
        self.variant = rules.variant_of(self.arch, self.arch_field("expert_count"))
        rope_factors = ROPE_FACTOR_TENSORS if self.arch == "phi3" else {}
        self.rope_factors = {rope_factors[t.name]: [_shortest_float(x) for x in np.asarray(t.data, np.float32)]
                             for t in self.reader.tensors if t.name in rope_factors}
        self.weights = [t for t in self.reader.tensors if t.name not in rope_factors]
        self.tensor_names = [t.name for t in self.weights]
        for name in self.tensor_names:  # fail before any work on an unknown tensor
            hf_tensor_name(name, self.variant)

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def arch_field(self, key: str, default=None):
        return self.field(f"{self.arch}.{key}", default)

    def hf_config_fields(self) -> dict:
        """Keyword arguments for transformers' LlamaConfig / Qwen2Config."""
        hidden = self.arch_field("embedding_length")
        heads = self.arch_field("attention.head_count")
        if hidden is None or heads is None or self.arch_field("block_count") is None:
            raise ConfigError(f"{self.path} lacks the {self.arch}.* shape metadata")
        embed_rows = next((t.data.shape[0] for t in self.reader.tensors if t.name == "token_embd.weight"), None)
        fields = {
            "architectures": [rules.VARIANTS.get(self.variant, (SUPPORTED_ARCHITECTURES[self.arch],))[0]],
            "hidden_size": hidden,
            "intermediate_size": self.arch_field("feed_forward_length"),
            "num_hidden_layers": self.arch_field("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.arch_field("attention.head_count_kv", heads),
            "rms_norm_eps": _shortest_float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": _shortest_float(self.arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": self.arch_field("context_length", 2048),
            "vocab_size": self.arch_field("vocab_size", embed_rows),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id"),
            "torch_dtype": "float32",
        }
        head_dim = self.arch_field("attention.key_length", hidden // heads)
        rotary_dim = self.arch_field("rope.dimension_count", head_dim)
        if rotary_dim != head_dim and self.arch != "phi3":
            raise ConfigError(f"{self.path}: partial rotary embeddings are not supported for {self.arch}")
        if self.variant in rules.GEMMA:
            fields.update(rules.gemma_fields(self, self.variant, fields, self._rope_scaling()))
            return fields
        if self.variant in rules.EXPERT_TENSORS:
            fields.update(rules.moe_fields(self, self.variant, fields))
        if self.variant == "mixtral":
            fields["head_dim"] = head_dim
        elif self.arch in ("llama", "qwen3", "qwen3moe"):
            fields["head_dim"] = head_dim
            fields["attention_bias"] = "blk.0.attn_q.bias" in self.tensor_names
        elif head_dim != hidden // heads:
            raise ConfigError(f"{self.path}: head_dim {head_dim} != hidden_size / heads, unsupported for {self.arch}")
        if self.arch == "qwen2moe":
            fields["head_dim"] = head_dim
        if self.variant == "llama":
            fields["mlp_bias"] = "blk.0.ffn_up.bias" in self.tensor_names
        if self.arch == "phi3":
            fields.update(self._phi3_fields(fields, rotary_dim / head_dim))
        elif (rope_scaling := self._rope_scaling()) is not None:
            fields["rope_scaling"] = rope_scaling
        return fields

    def _phi3_fields(self, fields: dict, partial_rotary_factor: float) -> dict:
        """phi3's rope (LongRoPE factors when the file has them, partial rotary) and window
        (llama.cpp writes 0 for none), as transformers' Phi3Config takes them."""
        original = self.arch_field("rope.scaling.original_context_length", fields["max_position_embeddings"])
        rope = {"rope_type": "default", "rope_theta": fields["rope_theta"],
                "partial_rotary_factor": partial_rotary_factor}
        if self.rope_factors:
            if set(self.rope_factors) != {"short_factor", "long_factor"}:
                raise ConfigError(f"{self.path} has only one of rope_factors_short / rope_factors_long")
            rope.update(rope_type="longrope", **self.rope_factors)
            scale = fields["max_position_embeddings"] / original
            derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
            stored = self.arch_field("rope.scaling.attn_factor")
            if stored is not None and not math.isclose(stored, derived, rel_tol=1e-6):
                rope["attention_factor"] = _shortest_float(stored)  # transformers would derive another
        return {"rope_scaling": rope, "original_max_position_embeddings": original,
                "sliding_window": self.arch_field("attention.sliding_window") or None}

    def _rope_scaling(self) -> dict | None:
        kind = self.arch_field("rope.scaling.type", "none")
        if kind == "none":
            return None
        factor = _shortest_float(self.arch_field("rope.scaling.factor", 1.0))
        if kind == "linear":
            return {"rope_type": "linear", "factor": factor}
        if kind == "yarn":
            return {"rope_type": "yarn", "factor": factor,
                    "original_max_position_embeddings": self.arch_field("rope.scaling.original_context_length")}
        raise ConfigError(f"rope scaling type {kind!r} in {self.path} is not supported")

    def eos_token_ids(self) -> list[int]:
        """EOS plus end-of-turn / end-of-message ids, which also end a generation."""
        ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            token_id = self.field(f"tokenizer.ggml.{key}")
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
        return ids

    def hf_tensors(self, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, np.ndarray]]:
        """(hf_name, float32 array) for every tensor, dequantized and un-permuted (Gemma's norms
        shifted back, stacked experts split: see gguf_arch_rules)."""
        from gguf.quants import dequantize

        # Only llama-arch files get the rotary permutation in convert_hf_to_gguf;
        # qwen2/qwen3/phi3 use NEOX-style rope in llama.cpp and store HF order.
        permuted = {"attn_q": num_heads, "attn_k": num_kv_heads} if self.arch == "llama" else {}
        for tensor in self.weights:
            hf_name = hf_tensor_name(tensor.name, self.variant)
            weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
            if part in permuted:  # llama.cpp permutes q/k biases exactly like the weights
                weight = unpermute_rotary_rows(weight, permuted[part])
            weight = rules.shift_back(self.variant, part or tensor.name.split(".")[0], weight)
            if "{e}" in hf_name:
                yield from rules.split_experts(hf_name, weight)
            else:
                yield hf_name, np.ascontiguousarray(weight)

    def tensor_nbytes_f32(self) -> list[int]:
        """Bytes of each HF tensor hf_tensors yields, in its order (an expert stack: one per expert)."""
        sizes = []
        for t in self.weights:
            experts = int(t.shape[-1]) if "{e}" in hf_tensor_name(t.name, self.variant) else 1
            sizes += [int(t.n_elements) * 4 // experts] * experts
        return sizes


def _shard_sizes(nbytes: list[int], max_shard_bytes: int) -> list[int]:
    """How many consecutive tensors go in each shard (greedy, never empty)."""
    counts, current, count = [], 0, 0
    for size in nbytes:
        if count and current + size > max_shard_bytes:
            counts.append(count)
            current, count = 0, 0
        current += size
        count += 1
    counts.append(count)
    return counts


def _write_weights(model: GGUFModel, out_dir: str, fields: dict, *, progress: bool, max_shard_bytes: int) -> None:
    from safetensors.numpy import save_file
    from tqdm import tqdm

    shards = _shard_sizes(model.tensor_nbytes_f32(), max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map: dict[str, str] = {}
    tensors = model.hf_tensors(fields["num_attention_heads"], fields["num_key_value_heads"])
    bar = tqdm(total=len(model.tensor_nbytes_f32()), desc=f"Converting {os.path.basename(model.path)}",
               unit="tensor", file=sys.stderr, disable=not progress)
    with bar:
        for shard_name, count in zip(names, shards):
            shard: dict[str, np.ndarray] = {}
            for _ in range(count):
                hf_name, weight = next(tensors)
                shard[hf_name] = weight
                weight_map[hf_name] = shard_name
                bar.update(1)
            save_file(shard, os.path.join(out_dir, shard_name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(model.tensor_nbytes_f32())}, "weight_map": weight_map}
        _write_json(os.path.join(out_dir, "model.safetensors.index.json"), index)


def _write_tokenizer(model: GGUFModel, out_dir: str, max_len: int) -> None:
    """transformers builds the fast tokenizer from the GGUF metadata; we save it
    as tokenizer.json + tokenizer_config.json (+ chat template) and check that
    a plain `AutoTokenizer.from_pretrained(out_dir)` gets the template back."""
    from transformers import AutoTokenizer

    if model.field("tokenizer.ggml.tokens") is None:
        raise ConfigError(f"{model.path} has no tokenizer metadata (tokenizer.ggml.tokens)")
    directory, filename = os.path.split(os.path.abspath(model.path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename, local_files_only=True)
    template = model.field("tokenizer.chat_template")
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.model_max_length = max_len
    tokenizer.save_pretrained(out_dir)
    reloaded = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    if reloaded.chat_template != template or len(reloaded) != len(tokenizer):
        raise ConfigError(f"the tokenizer saved from {model.path} does not reload intact")


def _write_configs(model: GGUFModel, out_dir: str, fields: dict) -> None:
    from transformers import AutoConfig

    model_type = rules.VARIANTS.get(model.variant, (None, model.arch))[1]
    AutoConfig.for_model(model_type, **fields).save_pretrained(out_dir)
    eos = model.eos_token_ids()
    generation = {"bos_token_id": fields["bos_token_id"], "eos_token_id": eos[0] if len(eos) == 1 else eos}
    if fields["pad_token_id"] is not None:
        generation["pad_token_id"] = fields["pad_token_id"]
    _write_json(os.path.join(out_dir, "generation_config.json"), generation)


def _make_readable(directory: str) -> None:
    os.chmod(directory, 0o755)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o644)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def convert_gguf_to_hf(gguf_path: str, out_dir: str, *, progress: bool = True,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Convert `gguf_path` into the HF directory `out_dir` (which must not
    exist yet) and return `out_dir`. If another process publishes `out_dir`
    first, its result is kept and ours discarded."""
    out_dir = os.path.abspath(out_dir)
    parent, leaf = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    started = time.monotonic()
    model = GGUFModel(gguf_path)
    fields = model.hf_config_fields()
    tmp_dir = tempfile.mkdtemp(prefix=f".{leaf}.tmp-", dir=parent)
    try:
        # Cheap parts first, so an unsupported file fails before the long tensor pass.
        _write_configs(model, tmp_dir, fields)
        _write_tokenizer(model, tmp_dir, fields["max_position_embeddings"])
        _write_weights(model, tmp_dir, fields, progress=progress, max_shard_bytes=max_shard_bytes)
        _write_json(os.path.join(tmp_dir, MARKER_FILE), {
            "converter_version": CONVERTER_VERSION,
            "source": os.path.abspath(gguf_path),
            "source_size": os.path.getsize(gguf_path),
            "seconds": round(time.monotonic() - started, 2),
        })
        _make_readable(tmp_dir)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(tmp_dir, out_dir)  # the commit point: out_dir appears complete or not at all
        except OSError:
            if not os.path.isfile(os.path.join(out_dir, MARKER_FILE)):
                raise
            logger.info("%s was converted concurrently by another process; keeping that copy", out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("converted %s -> %s in %.1fs", gguf_path, out_dir, time.monotonic() - started)
    return out_dir
