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
_EXPORTS = {
    "LLM": "pagedserve.offline.llm",
    "SamplingParams": "common.sampling_params",
    "BeamSearchParams": "common.beam_search",
    "PoolingParams": "common.pooling_params",
    "LoRARequest": "common.lora_request",
    "EmbeddingRequestOutput": "pagedserve.offline.offline_embed",
    "EmbeddingOutput": "pagedserve.offline.offline_embed",
    "GenerationOutput": "pagedserve.offline.offline_outputs",
    "CompletionOutput": "pagedserve.offline.offline_outputs",
    "RequestOutput": "pagedserve.offline.offline_outputs",  # vLLM's name for one prompt's result
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
    module = importlib.import_module(_EXPORTS[name])
    value = getattr(module, "GenerationOutput" if name == "RequestOutput" else name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "GenerationOutput", "CompletionOutput",
           "PoolingParams", "EmbeddingRequestOutput", "EmbeddingOutput", "LoRARequest"]
