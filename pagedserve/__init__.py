"""pagedserve: the user-facing API on top of the components.

`from pagedserve import LLM, SamplingParams` gives the offline engine (the
scheduler and one worker in this process), as `from vllm import ...` does.
The components (frontend, tokenizer_pool, scheduler, worker) never import
this package; it imports them.
"""
from __future__ import annotations

from common.beam_search import BeamSearchParams
from common.lora_request import LoRARequest
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from pagedserve.offline.llm import LLM
from pagedserve.offline.offline_embed import EmbeddingOutput, EmbeddingRequestOutput
from pagedserve.offline.offline_outputs import CompletionOutput, GenerationOutput

RequestOutput = GenerationOutput  # vLLM's name for one prompt's result

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "GenerationOutput", "CompletionOutput",
           "PoolingParams", "EmbeddingRequestOutput", "EmbeddingOutput", "LoRARequest"]
