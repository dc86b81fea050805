"""When `--quantization gguf` applies, and its fallbacks to the dequantized path."""
from __future__ import annotations

import logging
from typing import Any

from common.config import EngineConfig
from common.model_files import check_quantization_source, gguf_source_path

logger = logging.getLogger(__name__)


def gguf_default(config: EngineConfig, model: Any = None) -> str:
    """The method for an unset --quantization: "gguf" for a .gguf model, else "none"; "none" too
    for a `model` the quantized kernels cannot run (Gemma's GELU MLP, mixture-of-experts), so a
    .gguf of those runs dequantized while an explicit --quantization gguf is refused."""
    if not gguf_source_path(config.model):
        return "none"
    return "gguf" if model is None or gguf_kernels_fit(model) else "none"


def gguf_kernels_fit(model: Any) -> bool:
    """Whether the quantized kernels can multiply `model`'s layers: a SiLU MLP, no experts."""
    return getattr(model, "quantizable", True) and all(getattr(layer, "mlp", None) is None
                                                       for layer in model.layers)


def gguf_path_of(config: EngineConfig) -> str:
    """The .gguf file of `config`'s model; ConfigError for a model that is not one."""
    return check_quantization_source(config.model, "gguf")


def prepare_gguf(model: Any, config: EngineConfig) -> str:
    """Pack `model`'s layers from its .gguf file's quantized blocks; where the kernels cannot run
    them (no AVX-512 or AVX512-BF16 for bfloat16, float16, CUDA) or under tensor parallelism,
    the dequantized path, said in a log line. Returns the method used."""
    from worker.models.packed_linear import packing_supported
    from worker.quantization.gguf_model import quantize_layers

    path = gguf_path_of(config)
    if not model.layers:
        return "gguf"
    if model.sizes.tp_size > 1 or not packing_supported(model.layers[0].qkv_weight):
        why = ("tensor parallelism splits the blocks" if model.sizes.tp_size > 1
               else f"the CPU kernels cannot multiply them at {model.dtype} on {model.device}")
        logger.warning("--quantization gguf: running the dequantized weights instead (%s)", why)
        model.pack_weights()
        return "none"
    used = quantize_layers(model, path)
    logger.info("GGUF quantized matmuls: %s", ", ".join(f"{n} x {kind}" for kind, n in sorted(used.items())))
    return "gguf"
