"""A request's LoRA adapter (vLLM's LoRARequest): which adapter, by name, and where its
PEFT files are. It travels with the request from the frontend (or the offline LLM) through
the scheduler, whose prefix cache keys blocks by `lora_name`, to the worker, which loads
the adapter from `lora_path` the first time it sees the name."""
from __future__ import annotations

import json
import os
import re

import msgspec

# The PEFT target modules served: the projections of attention and of the dense MLP.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A PEFT weight's name: base_model.model.model.layers.<layer>.<self_attn|mlp>.<part>.lora_<A|B>.weight
WEIGHT_KEY = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
WEIGHTS_FILE = "adapter_model.safetensors"


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    lora_name: str  # the served model name of the adapter; two requests share KV only under one name
    lora_int_id: int  # > 0; vLLM's id, kept for its callers (adapters are keyed by name here)
    lora_path: str  # a directory with adapter_config.json and adapter_model.safetensors (PEFT)

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest needs a non-empty lora_name")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest lora_int_id must be at least 1, got {self.lora_int_id}")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: missing files, unsupported settings or shapes."""


def read_adapter_config(path: str, max_rank: int | None = None) -> dict:
    """A PEFT LoRA adapter's adapter_config.json, checked for what can be served (the frontend
    checks this at load; the worker also checks the rank against max_lora_rank and the shapes)."""
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: no adapter_config.json (a PEFT adapter directory is needed)")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: unreadable adapter_config.json: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {path!r}: peft_type {config.get('peft_type')!r} is not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: rank r must be a positive integer, got {rank!r}")
    if max_rank is not None and rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: rank {rank} exceeds max_lora_rank {max_rank}")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: target_modules as a pattern ({targets!r}) is not "
                               f"supported; list modules among {SUPPORTED_TARGETS}")
    unsupported = sorted(set(targets) - set(SUPPORTED_TARGETS))
    if unsupported:
        raise LoRAAdapterError(f"LoRA adapter {path!r}: target modules {unsupported} are not supported "
                               f"(supported: {SUPPORTED_TARGETS})")
    for key, allowed in (("bias", ("none", None)), ("fan_in_fan_out", (False, None)), ("use_dora", (False, None)),
                         ("modules_to_save", (None, [])), ("rank_pattern", (None, {})), ("alpha_pattern", (None, {}))):
        if config.get(key) not in allowed:
            raise LoRAAdapterError(f"LoRA adapter {path!r}: {key}={config.get(key)!r} is not supported")
    return config


def check_adapter_files(path: str, max_rank: int | None = None) -> dict:
    """What can be checked without the model (the frontend at load time, before accepting an
    adapter): a directory with a servable adapter_config.json and adapter_model.safetensors whose
    header names only lora_A/lora_B weights of supported modules, of rank `r`. Shapes against
    the base model are the worker's check (a request with an adapter that fails it gets a 400)."""
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter {path!r}: no such directory")
    config = read_adapter_config(path, max_rank)
    weights_file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_file):
        pickled = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise LoRAAdapterError(f"LoRA adapter {path!r}: no {WEIGHTS_FILE}" + (
            " (adapter_model.bin is a pickle, never loaded: save the adapter with safe_serialization=True)"
            if pickled else ""))
    for key, shape in safetensors_shapes(weights_file).items():
        match = WEIGHT_KEY.search(key)
        if match is None or match.group(2) not in SUPPORTED_TARGETS:
            raise LoRAAdapterError(f"LoRA adapter {path!r}: unsupported weight {key!r}")
        rank_dim = shape[0] if match.group(3) == "A" else shape[-1]
        if len(shape) != 2 or rank_dim != config["r"]:
            raise LoRAAdapterError(f"LoRA adapter {path!r}: weight {key!r} of shape {shape} is not of rank "
                                   f"r={config['r']}")
    return config


def safetensors_shapes(file: str) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header (the safetensors library checks
    it against the file's size); the data is not read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="numpy") as f:
            return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise LoRAAdapterError(f"{file!r} is not a valid safetensors file (corrupt or truncated?): {e}") from None
