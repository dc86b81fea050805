"""What the frontend asks the engine for: one request's prompt token ids and
sampling parameters. `Generator` sends it to the scheduler and the request
log prints it (`--enable-log-requests`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.lora_request import LoRARequest
from common.protocol import ImageInput
from common.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerationRequest:
    """Stop strings and detokenization switches come with the sampling params."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter its `model` named (frontend.lora_modules)
    images: list[ImageInput] = field(default_factory=list)  # from the tokenizer pool, passed on untouched
