"""How a model's linear layers keep and multiply their weights (`--quantization`):
"none" packs them at the model's dtype for the CPU kernel (`LlamaForCausalLM.pack_weights`);
"int8" and "gguf" replace them with quantized copies and the kernels that multiply those."""
from __future__ import annotations

from typing import Any

from common.config import EngineConfig
from common.errors import ConfigError
from worker.quantization.gguf_choice import gguf_default, prepare_gguf


def resolved_quantization(config: EngineConfig) -> str:
    """The method `config` asks for; unset: "gguf" for a .gguf model, else "none"."""
    return config.quantization or gguf_default(config)


def prepare_linear_weights(model: Any, config: EngineConfig) -> str:
    """Pack or quantize `model`'s matmul weights as `config` asks (after load_weights); returns
    the method used."""
    method = resolved_quantization(config)
    if method == "gguf":
        return prepare_gguf(model, config)
    if method == "none":
        model.pack_weights()  # on AVX-512 CPUs: matmul weights packed for the CPU kernel
        return method
    raise ConfigError(f"--quantization {method} is not available yet")
