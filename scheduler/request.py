"""The scheduler's state for one request, and its stop conditions."""
from __future__ import annotations

import enum

import msgspec

from common.protocol import EngineRequest, FinishReason, PromptLogprobs, TokenLogprobs, sample_request_id
from common.sampling_params import SamplingParams
from scheduler.prefix_hash import BlockHash, extend_block_hashes, lora_cache_key


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never admitted yet
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, KV freed
    FINISHED = "finished"


class Request:
    """Token ids known so far (prompt + outputs), how many of them are in the
    KV cache, and the hashes of the full blocks among them.

    The request's block table lives in the KVCacheManager (it alone mutates
    block ref counts); `num_computed_tokens` is advanced when a step is
    scheduled, like vLLM, so a running request's next chunk starts there.
    """

    def __init__(self, engine_request: EngineRequest, arrival_order: int, max_model_len: int,
                 block_size: int, enable_caching: bool, sample_index: int = 0,
                 output_token_ids: list[int] = ()):
        """`sample_index`: which sample of a request with several (n > 1 or
        best_of); each sample is a Request of its own, with its own id.
        `output_token_ids`: what a resumed request had produced already (it
        carries on like a request preempted by recompute)."""
        params = engine_request.sampling_params
        self.external_id = engine_request.request_id  # what outputs report
        self.sample_index = sample_index
        self.request_id = (engine_request.request_id if params.num_samples == 1
                           else sample_request_id(engine_request.request_id, sample_index))
        self.prompt_token_ids = list(engine_request.prompt_token_ids)
        self.output_token_ids: list[int] = list(output_token_ids)
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        self.attempt = engine_request.attempt
        self.pooling_params = engine_request.pooling_params  # set: pool the prompt, never sample
        self.images = engine_request.images  # sent to the worker with the request
        self.image_spans = [(image.offset, image.length, image.content_hash) for image in self.images]
        self.sampling_params: SamplingParams = params.for_sample(sample_index)
        # Logprobs of prompt tokens 1.., gathered over the prefill chunks; sent with the first output.
        self.prompt_logprobs: list[TokenLogprobs] | None = (
            [] if self.sampling_params.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = False
        self.priority = engine_request.priority
        self.arrival_order = arrival_order  # ties between equal priorities
        self.cache_salt = engine_request.cache_salt
        self.lora_request = engine_request.lora_request  # its adapter, if any: part of every block's key
        self.stop_token_ids = frozenset(self.sampling_params.stop_token_ids)
        room = max_model_len - len(self.prompt_token_ids)
        requested = self.sampling_params.max_tokens
        self.max_tokens = room if requested is None else min(requested, room)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prompt prefix hits at first admission
        self.sent_to_worker = False  # False: the next plan carries NewRequestData
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []  # drafts the worker proposed, checked next step
        self.blocks_trimmed = False  # blocks given back since the last plan (the worker must drop them too)
        self._block_size = block_size
        self._enable_caching = enable_caching
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def collecting_prompt_logprobs(self) -> bool:
        """Prompt logprobs are wanted and not all sent: every prompt position
        must then be computed (no prefix-cache hits)."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position must be computed, so no prefix-cache hits: prompt logprobs
        are being gathered, or the request pools over more than its last token (MEAN, CLS)."""
        pooling = self.pooling_params
        return self.collecting_prompt_logprobs or (pooling is not None and pooling.pooling_type != "LAST")

    @property
    def worker_params(self) -> SamplingParams:
        """What the worker samples with (a re-admitted request whose prompt
        logprobs went out already does not score its prompt again)."""
        if self.prompt_logprobs_sent and self.sampling_params.prompt_logprobs is not None:
            return msgspec.structs.replace(self.sampling_params, prompt_logprobs=None)
        return self.sampling_params

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Keep the positions not gathered yet (a recomputed chunk repeats some)."""
        if not self.collecting_prompt_logprobs:
            return
        gathered = self.prompt_logprobs
        skip = len(gathered) + 1 - chunk.first_token_index
        if skip < 0:
            raise ValueError(f"{self.request_id}: prompt logprobs from token {chunk.first_token_index}, "
                             f"but only {len(gathered)} gathered")
        gathered.extend(chunk.positions[skip:])

    def take_prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """The prompt logprobs, the first time they are complete (else None)."""
        if not self.collecting_prompt_logprobs or len(self.prompt_logprobs) < self.num_prompt_tokens - 1:
            return None
        self.prompt_logprobs_sent = True
        gathered, self.prompt_logprobs = self.prompt_logprobs, []
        return gathered

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def lose_kv(self) -> None:
        """Its KV is gone (preempted, or its worker lost): it waits to be recomputed, tokens kept."""
        self.num_computed_tokens = 0
        self.spec_token_ids = []
        self.status = RequestStatus.PREEMPTED

    def append_until_stop(self, token_ids: list[int], eos_token_ids: frozenset[int],
                          max_model_len: int) -> tuple[list[int], FinishReason | None]:
        """Append a step's new tokens (accepted drafts, then the sampled one) up to the first
        that stops the request; (the tokens appended, why it stopped or None)."""
        appended = []
        for token in token_ids:
            self.append_output_token(token)
            appended.append(token)
            reason = self.check_stop(eos_token_ids, max_model_len)
            if reason is not None:
                return appended, reason
        return appended, None

    def _update_block_hashes(self) -> None:
        # Hashes cover every full block of known tokens; whether a block may
        # be cached (its KV computed) is the KV cache manager's decision.
        if self._enable_caching:
            extend_block_hashes(self.block_hashes, self.all_token_ids, self._block_size, self.cache_salt,
                                self.image_spans, lora_cache_key(self.lora_request))

    def check_stop(self, eos_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
        """Why the request stops after its latest output token, if it does.

        EOS and stop_token_ids count only once min_tokens outputs exist; they
        win over a length limit reached by the same token (the sequence did
        end naturally), as in current vLLM.
        """
        params = self.sampling_params
        last_token = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last_token in eos_token_ids:
                return FinishReason.STOP
            if last_token in self.stop_token_ids:
                return FinishReason.STOP
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
