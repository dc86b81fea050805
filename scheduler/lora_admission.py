"""Which requests may run together under multi-LoRA: a step holds at most `max_loras` distinct
adapters (the worker's device slots), so a waiting request whose adapter is not among the
running ones waits while that many are running (vLLM's rule); requests without one always fit."""
from __future__ import annotations

from collections.abc import Iterable

from common.config import EngineConfig
from common.errors import InvalidRequestError
from common.protocol import EngineRequest


def check_lora_request(engine_request: EngineRequest, config: EngineConfig) -> None:
    if engine_request.lora_request is not None and not config.enable_lora:
        raise InvalidRequestError("the request names a LoRA adapter but LoRA is not enabled (enable_lora)",
                                  param="model")


def exceeds_lora_slots(running: Iterable, request, max_loras: int) -> bool:
    """Whether admitting `request` would put more than `max_loras` adapters in the running set,
    or two versions of one adapter name (unloaded and loaded again: the worker holds one adapter
    per name, so the new version waits until the old one's requests are done)."""
    lora = request.lora_request
    if lora is None:
        return False
    running_loras = {r.lora_request for r in running if r.lora_request is not None}
    if lora in running_loras:
        return False
    names = {other.lora_name for other in running_loras}
    return lora.lora_name in names or len(names) >= max_loras
