"""pagedserve: the user-facing API on top of the components.

`from pagedserve import LLM, SamplingParams` gives the offline engine (the
scheduler and one worker in this process), as `from vllm import ...` does.
The components (frontend, tokenizer_pool, scheduler, worker) never import
this package; it imports them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Imported on first use (PEP 562): every component process starts as `python -m pagedserve.cli`,
# which imports this package, and the frontend, scheduler and tokenizer pool must not pay for
# (or hold the memory of) torch, which the offline engine brings in.
_EXPORTS = {  # name: (module, attribute)
    "LLM": ("pagedserve.offline.llm", "LLM"),
    "SamplingParams": ("common.sampling_params", "SamplingParams"),
    "BeamSearchParams": ("common.beam_search", "BeamSearchParams"),
    "PoolingParams": ("common.pooling_params", "PoolingParams"),
    "LoRARequest": ("common.lora_request", "LoRARequest"),
    "EmbeddingRequestOutput": ("pagedserve.offline.offline_embed", "EmbeddingRequestOutput"),
    "EmbeddingOutput": ("pagedserve.offline.offline_embed", "EmbeddingOutput"),
    "GenerationOutput": ("pagedserve.offline.offline_outputs", "GenerationOutput"),
    "CompletionOutput": ("pagedserve.offline.offline_outputs", "CompletionOutput"),
    # vLLM's name for one prompt's result
    "RequestOutput": ("pagedserve.offline.offline_outputs", "GenerationOutput"),
}

if TYPE_CHECKING:
    from common.beam_search import BeamSearchParams
    from common.lora_request import LoRARequest
    from common.pooling_params import PoolingParams
    from common.sampling_params import SamplingParams
    from pagedserve.offline.llm import LLM
    from pagedserve.offline.offline_embed import EmbeddingOutput, EmbeddingRequestOutput
    from pagedserve.offline.offline_outputs import CompletionOutput, GenerationOutput
    RequestOutput = GenerationOutput


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    import importlib
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = list(_EXPORTS)
