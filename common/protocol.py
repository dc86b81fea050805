"""Every message that crosses a socket, as msgspec Structs.

Wire format (ZeroMQ): frame 0 is one byte, the MessageType; frame 1 is the
msgpack body. Each socket decodes only the types it expects (see
`common.transport`), so a stray or malformed frame is dropped, never executed.
No pickle anywhere. Bump PROTOCOL_VERSION on any incompatible change.
"""
from __future__ import annotations

import enum

import msgspec

from common.lora_request import LoRARequest
from common.pooling_params import PoolerInfo, PoolingParams
from common.sampling_params import SamplingParams

PROTOCOL_VERSION = 2  # 2: StepPlan.kv_copies (partial prefix hits)


class MessageType(enum.IntEnum):
    # frontend -> scheduler
    ENGINE_REQUEST = 1
    ABORT = 2
    FRONTEND_HELLO = 3  # also the frontend heartbeat
    # scheduler -> frontend
    ENGINE_OUTPUTS = 10
    ENGINE_ERROR = 11
    # scheduler <-> worker
    WORKER_HELLO = 20
    WORKER_READY = 21
    STEP_PLAN = 22
    STEP_RESULT = 23
    SHUTDOWN = 24
    WORKER_GOODBYE = 25
    # rank 0 -> the other ranks of its worker group (over torch.distributed)
    GROUP_CONTROL = 26
    # the offline LLM <-> its other data-parallel replicas
    REPLICA_JOB = 27
    REPLICA_RESULTS = 28
    # frontend <-> tokenizer pool
    TOKENIZE = 30
    RENDER_CHAT = 31
    DETOKENIZE = 32
    TOKENIZER_REPLY = 33
    TOKENIZER_READY = 34  # a tokenizer worker announcing itself to the router


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id, or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # aborted by the client or the frontend

    @property
    def openai_name(self) -> str:
        return self.name.lower()


_STRUCT = dict(omit_defaults=True, gc=False, kw_only=True)

# --------------------------------------------------------------------------
# frontend <-> scheduler


class ResumedSample(msgspec.Struct, **_STRUCT):
    """What one sample of a resubmitted request had produced when its scheduler was lost."""
    index: int
    output_token_ids: list[int]
    finished: bool = False  # ended already (its finish reached the frontend, or a stop string ended it there)


class TensorData(msgspec.Struct, **_STRUCT):
    """A tensor as raw C-order bytes with its numpy dtype name ("float32") and shape: how
    pixel values cross sockets (msgpack bytes, never pickle)."""
    data: bytes
    dtype: str
    shape: list[int]


class ImageInput(msgspec.Struct, **_STRUCT):
    """One image of a prompt: the processor's pixel values, and where its placeholder tokens
    are (prompt_token_ids[offset:offset + length], one per embedding row the vision encoder
    yields). `content_hash` (hex SHA-256 of the pixels) keys the prefix cache, so two images
    behind the same placeholder ids never share KV blocks. `grid_thw`: Qwen2-VL's patch grid
    (t, h, w) of the image, whose pixel_values are its [t*h*w, patch] rows; [] for others."""
    offset: int
    length: int
    content_hash: str
    pixel_values: TensorData
    grid_thw: list[int] = []


class EngineRequest(msgspec.Struct, **_STRUCT):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None  # separates prefix-cache namespaces
    # A resubmission after the scheduler was lost (restarted, or dropped this frontend): `attempt`
    # counts them, every output and error echoes it (so the frontend can tell a stale one), and
    # `resumed` lists the samples that had output tokens or had finished: they carry on from there.
    attempt: int = 0
    resumed: list[ResumedSample] = []
    # Set: an embedding request (prefill only); its output carries `embedding`, not tokens.
    pooling_params: PoolingParams | None = None
    images: list[ImageInput] = []  # a vision-language model's image inputs, in prompt order
    lora_request: LoRARequest | None = None  # the adapter this request runs with; None: the base model


class Abort(msgspec.Struct, **_STRUCT):
    request_ids: list[str]


class FrontendHello(msgspec.Struct, **_STRUCT):
    frontend_id: str
    protocol_version: int = PROTOCOL_VERSION


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities at one position, from the model's raw float32 logits
    (log-softmax before any penalty, bias or temperature, as vLLM by default)."""
    token_id: int  # the chosen token: the sampled one, or the actual next prompt token
    logprob: float
    rank: int  # of the chosen token; 1 = the most likely
    top_token_ids: list[int] = []  # the k most likely tokens, most likely first
    top_logprobs: list[float] = []


class PromptLogprobs(msgspec.Struct, **_STRUCT):
    """Logprobs of consecutive prompt tokens (the first prompt token has none)."""
    first_token_index: int  # index in the prompt of the token positions[0] scores (>= 1)
    positions: list[TokenLogprobs]


def sample_request_id(request_id: str, index: int) -> str:
    """The scheduler's id for sample `index` of a request with several samples
    (n > 1 or best_of); the frontend aborts one sample by this id."""
    return f"{request_id}#{index}"


def parent_request_id(request_id: str) -> str:
    """The request a sample id belongs to (the id itself when it is no sample id)."""
    parent, _, index = request_id.rpartition("#")
    return parent if parent and index.isdigit() else request_id


class RequestOutput(msgspec.Struct, **_STRUCT):
    """What one request (one sample of it, see `index`) produced in one step."""
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None  # of this sample
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when the request was rejected (e.g. too long)
    index: int = 0  # which sample of the request (n > 1 or best_of)
    more_samples: bool = False  # other samples of the request still run: finish_reason ends only this one
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., once, with the first output
    attempt: int = 0  # the EngineRequest's
    embedding: list[float] | None = None  # a pooling request's vector (finishes it)

    @property
    def request_finished(self) -> bool:
        """Nothing more will come for this request id."""
        return self.finish_reason is not None and not self.more_samples


class EngineOutputs(msgspec.Struct, **_STRUCT):
    outputs: list[RequestOutput]
    timestamp: float = 0.0
    # The scheduler's waiting queue is at --max-waiting-requests: new requests
    # get a 429 until a message says otherwise (sent to every frontend on change).
    queue_full: bool = False
    # Requests (id -> attempt) the scheduler dropped because this frontend fell silent
    # while its connection stayed up: the frontend, if alive, resubmits them.
    dropped: dict[str, int] = {}


class EngineError(msgspec.Struct, **_STRUCT):
    request_id: str
    message: str
    status: int = 400
    attempt: int = 0  # the EngineRequest's


# --------------------------------------------------------------------------
# scheduler <-> worker


class WorkerHello(msgspec.Struct, **_STRUCT):
    """The worker's handshake: what the scheduler must know to plan."""
    rank: int
    model_name: str
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    dtype: str
    protocol_version: int = PROTOCOL_VERSION
    tensor_parallel_size: int = 1  # the ranks behind this worker (only rank 0 talks to the scheduler)
    pipeline_parallel_size: int = 1
    # Every layer attends to at most this many latest positions (0: some layer sees all):
    # the scheduler frees the blocks that fall out of the window.
    sliding_window: int = 0
    pooler: PoolerInfo | None = None  # set: a pooling model (embeddings only, no generation)


class WorkerReady(msgspec.Struct, **_STRUCT):
    """The scheduler's answer to WorkerHello. `scheduler_id` names the
    registration (the scheduler process and its worker session): a worker
    that sees a new one drops every request it holds, because they belonged
    to a scheduler that is gone or to a session it declared lost."""
    accepted: bool
    message: str = ""
    scheduler_id: str = ""
    # Not accepted yet: another worker is registered and alive. Keep saying
    # hello; this worker takes over if that one is lost.
    standby: bool = False


class NewRequestData(msgspec.Struct, **_STRUCT):
    """Sent once when a request is (re)admitted; replaces any state the worker
    holds for the same id (a preempted request comes back this way)."""
    request_id: str
    token_ids: list[int]  # prompt + tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (prefix hits)
    pooling_params: PoolingParams | None = None  # resolved (PoolerInfo.resolve): pool, do not sample
    images: list[ImageInput] = []  # the EngineRequest's
    lora_request: LoRARequest | None = None  # its adapter (worker.lora_slots); None: the base model


class CachedRequestData(msgspec.Struct, **_STRUCT):
    """A diff for a request the worker already holds."""
    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Set when the scheduler gave back blocks of the request (rejected drafts' slots) since the
    # last plan: keep only the first this many before appending new_block_ids. -1: keep all.
    num_blocks_kept: int = -1


class StepPlan(msgspec.Struct, **_STRUCT):
    """One engine step. `num_scheduled_tokens` lists every request that runs
    this step (in batch order) with how many of its tokens to compute,
    starting at its num_computed_tokens. A request samples when the chunk
    reaches the end of its known tokens."""
    step_id: int
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    num_scheduled_tokens: dict[str, int] = {}
    finished_request_ids: list[str] = []  # free these (finished, aborted or preempted)
    reset_prefix_cache: bool = False
    # Speculative decoding: draft tokens to check this step, after the request's last known token.
    # Such a request's num_scheduled_tokens counts them: 1 + len(drafts).
    draft_token_ids: dict[str, list[int]] = {}
    speculate: bool = False  # propose drafts for the requests that sample this step
    # Partial prefix hits, done before any KV is written: copy the first n slots of block src into dst.
    kv_copies: list[tuple[int, int, int]] = []  # (src, dst, n)


class StepResult(msgspec.Struct, **_STRUCT):
    step_id: int
    request_ids: list[str]  # requests that sampled this step
    sampled_token_ids: list[int]  # one per entry of request_ids
    execute_ns: int = 0
    sampled_logprobs: dict[str, TokenLogprobs] = {}  # for the sampling requests that asked
    prompt_logprobs: dict[str, PromptLogprobs] = {}  # prompt positions computed this step, when asked
    # Speculative decoding. `accepted_draft_ids`: the drafts the model accepted, which come before
    # the request's entry in sampled_token_ids (a rejected draft's place takes that token);
    # `draft_logprobs`: their logprobs, when the request asked. `proposals`: drafts for the next
    # step, from the request's tokens as this step left them.
    accepted_draft_ids: dict[str, list[int]] = {}
    draft_logprobs: dict[str, list[TokenLogprobs]] = {}
    proposals: dict[str, list[int]] = {}
    pooled: dict[str, list[float]] = {}  # pooling requests whose prompt ended this step: their vectors
    failed: dict[str, str] = {}  # requests not run (an unusable LoRA adapter) -> why; the scheduler fails them


class Shutdown(msgspec.Struct, **_STRUCT):
    reason: str = ""


class WorkerGoodbye(msgspec.Struct, **_STRUCT):
    """A worker stopping on purpose (SIGTERM, Ctrl-C): the plan it has not
    answered was never run, so unlike a crash this casts no suspicion on the
    plan's requests."""
    reason: str = ""


class GroupControl(msgspec.Struct, **_STRUCT):
    """Rank 0 to the other ranks of its group, between step plans: `keepalive` (an idle
    group's collectives must not time out), `reset` (a new scheduler session: drop every
    request), `stop` (the group is shutting down)."""
    action: str


# --------------------------------------------------------------------------
# the offline LLM <-> its other data-parallel replicas


class ReplicaJob(msgspec.Struct, **_STRUCT):
    """Prompts for one replica of an offline LLM with data_parallel_size > 1: each prompt's
    text (or None), token ids and (validated) sampling parameters."""
    prompts: list[str | None]
    prompt_token_ids: list[list[int]]
    sampling_params: list[SamplingParams]


class ReplicaResults(msgspec.Struct, **_STRUCT):
    """A replica's answer: the outputs (the offline LLM's GenerationOutput dataclasses, which the
    receiver decodes by type), or the error that stopped the job."""
    outputs: msgspec.Raw = msgspec.Raw(b"\x90")  # an empty msgpack array
    error: str | None = None
    invalid_request: bool = False  # the error is the request's fault (InvalidRequestError)


# --------------------------------------------------------------------------
# frontend <-> tokenizer pool


class ChatMessage(msgspec.Struct, **_STRUCT):
    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class TokenizeJob(msgspec.Struct, **_STRUCT):
    job_id: str
    text: str
    add_special_tokens: bool = True


class RenderChatJob(msgspec.Struct, **_STRUCT):
    job_id: str
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict = {}
    add_special_tokens: bool = False  # on top of the template's (vLLM's chat add_special_tokens)


class DetokenizeJob(msgspec.Struct, **_STRUCT):
    job_id: str
    token_ids: list[int]
    skip_special_tokens: bool = True


class TokenizerReply(msgspec.Struct, **_STRUCT):
    job_id: str
    token_ids: list[int] = []
    text: str = ""  # detokenized text, or the rendered chat prompt
    error: str | None = None
    status: int = 400  # HTTP-style status of `error`: 4xx bad input, 503 pool unavailable
    images: list[ImageInput] = []  # a chat with images: each image's pixels and placeholders


class TokenizerReady(msgspec.Struct, **_STRUCT):
    """A tokenizer worker's hello and heartbeat; `leaving`: it is stopping (SIGTERM), so the
    router hands what it held to other workers without counting that against the jobs."""
    worker_id: str
    leaving: bool = False


MESSAGE_TYPES: dict[MessageType, type[msgspec.Struct]] = {
    MessageType.ENGINE_REQUEST: EngineRequest,
    MessageType.ABORT: Abort,
    MessageType.FRONTEND_HELLO: FrontendHello,
    MessageType.ENGINE_OUTPUTS: EngineOutputs,
    MessageType.ENGINE_ERROR: EngineError,
    MessageType.WORKER_HELLO: WorkerHello,
    MessageType.WORKER_READY: WorkerReady,
    MessageType.STEP_PLAN: StepPlan,
    MessageType.STEP_RESULT: StepResult,
    MessageType.SHUTDOWN: Shutdown,
    MessageType.WORKER_GOODBYE: WorkerGoodbye,
    MessageType.GROUP_CONTROL: GroupControl,
    MessageType.REPLICA_JOB: ReplicaJob,
    MessageType.REPLICA_RESULTS: ReplicaResults,
    MessageType.TOKENIZE: TokenizeJob,
    MessageType.RENDER_CHAT: RenderChatJob,
    MessageType.DETOKENIZE: DetokenizeJob,
    MessageType.TOKENIZER_REPLY: TokenizerReply,
    MessageType.TOKENIZER_READY: TokenizerReady,
}
TYPE_OF: dict[type[msgspec.Struct], MessageType] = {cls: t for t, cls in MESSAGE_TYPES.items()}
