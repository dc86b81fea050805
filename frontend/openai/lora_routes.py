"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
POST /v1/unload_lora_adapter {"lora_name"}. Served only when PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING
(or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) is true, as in vLLM: anyone reaching the API could
otherwise make the worker read files. The frontend checks the adapter first (400 if bad; see
frontend.lora_modules). A loaded adapter is then a model name of this frontend; the worker reads
its files the first time a request uses it (and keeps up to --max-cpu-loras). Unloading removes
the name here; the worker drops its copy lazily (LRU): each load gets a new lora_int_id and the
worker and prefix cache key adapters by name, path and id, so a name loaded again (another path,
or the same with changed files) never reuses the old adapter's weights or cached KV."""
from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from common.errors import InvalidRequestError
from frontend.api_errors import ModelNotFoundError

_TRUE = ("1", "true", "yes", "on")


def runtime_lora_updating_allowed() -> bool:
    return any(os.environ.get(name, "").strip().lower() in _TRUE
               for name in ("PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"))


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # accepted for vLLM's clients; the name decides


def add_lora_routes(app: FastAPI, state) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if not body.lora_name or not body.lora_path:
            raise InvalidRequestError("lora_name and lora_path are required", param="lora_name")
        if body.lora_name in state.served_model_names:
            raise InvalidRequestError(f"{body.lora_name!r} is the base model's name", param="lora_name")
        state.lora_modules.add(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        if state.lora_modules.remove(body.lora_name) is None:
            raise ModelNotFoundError(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
