"""Everything the HTTP and gRPC servers of one frontend share."""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from frontend.engine.control_client import ControlClient
from frontend.engine.engine_client import EngineClient
from frontend.api_errors import ModelNotFoundError
from frontend.engine.generation import Generator
from frontend.engine.frontend_metrics import FrontendMetrics
from frontend.engine.request_log import RequestLogger
from frontend.responses_store import ResponseStore
from frontend.lora_modules import LoRAModules
from common.lora_request import LoRARequest

# Changes whenever the server (and so, possibly, its outputs) changes.
SYSTEM_FINGERPRINT = "fp_pagedserve_0.1.0"


@dataclass
class FrontendState:
    served_model_names: list[str]
    model_root: str  # what --model named; /v1/models reports it as `root`
    engine: EngineClient  # or, data parallel, a ReplicaRouter (the same interface)
    tokenizer_client: "TokenizerClient"  # noqa: F821 (tokenizer_pool.tokenizer_client)
    tokenizer: object  # the local HF tokenizer, for incremental detokenization
    control: ControlClient  # or, data parallel, ReplicaControls
    metrics: FrontendMetrics
    # The model's generation_config.json sampling values, for fields a request leaves unset.
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    tool_call_parser: str | None = None  # --tool-call-parser with --enable-auto-tool-choice: "auto" runs
    response_role: str = "assistant"  # --response-role: chat replies that open a new turn
    image_limit: int = 1  # --limit-mm-per-prompt's images per prompt (the tokenizer pool checks it too)
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: logprobs name tokens by id
    responses: ResponseStore = field(default_factory=ResponseStore)  # the Responses API's stored responses
    request_logger: RequestLogger | None = None  # --enable-log-requests
    created: int = field(default_factory=lambda: int(time.time()))
    lora_modules: LoRAModules = field(default_factory=LoRAModules)  # adapters served by name (--lora-modules)

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is required")
        self.generator = Generator(self.engine, self.tokenizer, self.control, self.metrics, self.request_logger)

    @property
    def model_name(self) -> str:
        """The name responses report (the first served name)."""
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        """Requests may omit `model`; a name we do not serve is a 404."""
        if model is not None and model not in self.served_model_names and model not in self.lora_modules.requests:
            raise ModelNotFoundError(model)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model."""
        return self.lora_modules.requests.get(model) if model is not None else None

    async def is_healthy(self) -> tuple[bool, str]:
        if not self.engine.connected:
            return False, "not connected to the scheduler"
        reply = await self.control.health()
        if reply is None:
            return False, "the scheduler's control service does not answer"
        if not reply.ok or not reply.worker_ready:
            return False, reply.message or "the scheduler is not ready"
        return True, "ok"

    async def metrics_text(self) -> bytes:
        """/metrics: the scheduler's numbers, or each replica's when there are several."""
        by_replica = getattr(self.control, "stats_by_replica", None)
        if by_replica is not None:
            return self.metrics.render(None, await by_replica())
        return self.metrics.render(await self.control.stats())

    async def max_model_len(self) -> int | None:
        info = await self.control.model_info()
        return info.max_model_len if info is not None and info.max_model_len else None


def random_id(prefix: str) -> str:
    """`prefix` holds its separator: "chatcmpl-" as OpenAI's chat ids, "resp_" as its responses'."""
    return f"{prefix}{secrets.token_hex(16)}"


def request_ids(raw_request, prefix: str) -> tuple[str, str]:
    """(the response id, the scheduler's id for it). The response id comes from
    the client's X-Request-Id header when given (as vLLM does); the scheduler's
    then gets a random suffix, since clients and proxies may send one header
    value on many concurrent requests."""
    header = raw_request.headers.get("x-request-id")
    if not header:
        response_id = random_id(prefix)
        return response_id, response_id
    response_id = f"{prefix}{header}"
    return response_id, f"{response_id}-{secrets.token_hex(4)}"
