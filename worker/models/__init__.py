"""Our model implementations, looked up by the checkpoint's `architectures[0]`."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace
from collections.abc import Iterable, Iterator
from typing import Any

from common.errors import ConfigError
from common.pooling_params import BARE_DECODER_ARCHITECTURES
from worker.models.gemma import Gemma2ForCausalLM
from worker.models.gemma3 import Gemma3ForCausalLM
from worker.models.llama import LlamaForCausalLM
from worker.models.llava import LlavaForConditionalGeneration
from worker.models.mistral import MistralForCausalLM
from worker.models.mixtral import MixtralForCausalLM
from worker.models.phi3 import Phi3ForCausalLM
from worker.models.qwen2 import Qwen2ForCausalLM
from worker.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from worker.models.qwen2_moe import Qwen2MoeForCausalLM
from worker.models.qwen3 import Qwen3ForCausalLM
from worker.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported() -> str:
    return ", ".join(sorted([*MODEL_REGISTRY, *BARE_DECODER_ARCHITECTURES, *ENCODER_ARCHITECTURES]))


def get_model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    """The class implementing `hf_config.architectures[0]`; ConfigError (a ValueError) naming
    the supported ones for anything else. No model code from a checkpoint is ever run, so
    --trust-remote-code cannot add one."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ConfigError("the model's config.json names no architecture (`architectures` is empty); "
                          f"supported: {supported()}")
    name = BARE_DECODER_ARCHITECTURES.get(architectures[0], architectures[0])  # a bare decoder: same class
    if name not in MODEL_REGISTRY:
        raise ConfigError(f"unsupported model architecture {architectures[0]!r}; supported: {supported()} "
                          "(pagedserve never runs a model repository's own code, --trust-remote-code or not)")
    return MODEL_REGISTRY[name]


ENCODER_ARCHITECTURES = ("BertModel",)  # served by worker.encoder_worker (embeddings only)


def check_architecture(model_dir: str) -> type[LlamaForCausalLM] | None:
    """get_model_class for the config.json in `model_dir`, read as plain JSON: checked before
    transformers parses it (which fails less clearly on a model type it does not know).
    None for a BERT-style encoder."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {model_dir}/config.json: {e}") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if architectures and architectures[0] in ENCODER_ARCHITECTURES:
        return None
    return get_model_class(SimpleNamespace(architectures=architectures))


def bare_checkpoint_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A bare decoder's tensors (`embed_tokens.weight`, `layers.0...`, `norm.weight`) under the
    causal-LM names our models load (`model.` prefixed; already prefixed names stay). Any
    `lm_head.weight` is dropped: a bare model only pools, so it has no LM head to load."""
    for name, tensor in weights:
        if name == "lm_head.weight":
            continue
        yield (name if name.startswith("model.") else "model." + name), tensor
