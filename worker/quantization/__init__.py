"""How a model's linear layers keep and multiply their weights (`--quantization`):
"none" packs them at the model's dtype for the CPU kernel (`LlamaForCausalLM.pack_weights`);
"int8" and "gguf" replace them with quantized copies and the kernels that multiply those."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from common.config import EngineConfig
from common.errors import ConfigError
from worker.quantization import compressed_checkpoint
from worker.quantization.gguf_choice import gguf_default, prepare_gguf


def resolved_quantization(config: EngineConfig, hf_config: Any = None, model: Any = None) -> str:
    """The method `config` asks for; unset: "int8" for a compressed-tensors W8A8 checkpoint
    (`hf_config`'s quantization_config), "gguf" for a .gguf model whose layers the GGUF kernels
    can run (gguf_choice.gguf_default: not for Gemma or mixture-of-experts `model`s), else "none"."""
    checkpoint = compressed_checkpoint.quantization_config(hf_config)
    if checkpoint is not None:
        if config.quantization not in (None, "int8"):
            raise ConfigError(f"--quantization {config.quantization} does not fit a compressed-tensors "
                              "W8A8 checkpoint: leave it unset or use int8")
        compressed_checkpoint.check_w8a8(checkpoint)
        return "int8"
    return config.quantization or gguf_default(config, model)


def checkpoint_weights(model: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors for `model.load_weights`: a compressed-tensors checkpoint's
    weight scales are kept aside (`model.checkpoint_scales`) for prepare_linear_weights."""
    if compressed_checkpoint.quantization_config(model.config) is None:
        return iter(weights)
    model.checkpoint_scales = {}
    return compressed_checkpoint.split_scales(weights, model.checkpoint_scales)


def prepare_linear_weights(model: Any, config: EngineConfig) -> str:
    """Pack or quantize `model`'s matmul weights as `config` asks (after load_weights); returns
    the method used."""
    method = resolved_quantization(config, model.config, model)
    if method != "none" and not getattr(model, "quantizable", True):
        raise ConfigError(f"--quantization {method} is not supported for {type(model).__name__} "
                          "(its kernels fuse a SiLU MLP); run it unquantized")
    if method in ("int8", "gguf") and any(layer.mlp is not None for layer in model.layers):
        raise ConfigError(f"--quantization {method} does not support mixture-of-experts models "
                          f"({type(model).__name__}): leave --quantization unset")
    if method == "gguf":
        return prepare_gguf(model, config)
    if method == "none":
        model.pack_weights()  # on AVX-512 CPUs: matmul weights packed for the CPU kernel
        return method
    if method == "int8":
        from worker.quantization import int8_weights
        return int8_weights.prepare_int8(model)
    raise ConfigError(f"--quantization {method} is not available yet")
