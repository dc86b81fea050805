"""Our model implementations, looked up by the checkpoint's `architectures[0]`."""
from __future__ import annotations

from typing import Any

from worker.models.gemma import Gemma2ForCausalLM
from worker.models.gemma3 import Gemma3ForCausalLM
from worker.models.llama import LlamaForCausalLM
from worker.models.mistral import MistralForCausalLM
from worker.models.mixtral import MixtralForCausalLM
from worker.models.phi3 import Phi3ForCausalLM
from worker.models.qwen2 import Qwen2ForCausalLM
from worker.models.qwen2_moe import Qwen2MoeForCausalLM
from worker.models.qwen3 import Qwen3ForCausalLM
from worker.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    """The class implementing `hf_config.architectures[0]`; ValueError for anything unsupported."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError("the model's config.json names no architecture (`architectures` is empty); "
                         f"supported: {sorted(MODEL_REGISTRY)}")
    name = architectures[0]
    if name not in MODEL_REGISTRY:
        raise ValueError(f"unsupported model architecture {name!r}; supported: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[name]
