"""The scheduler's state for one request, and its stop conditions."""
from __future__ import annotations

import enum

from common.protocol import EngineRequest, FinishReason
from common.sampling_params import SamplingParams
from scheduler.prefix_hash import BlockHash, extend_block_hashes


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
                 block_size: int, enable_caching: bool):
        self.request_id = engine_request.request_id
        self.prompt_token_ids = list(engine_request.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(self.prompt_token_ids)
        self.sampling_params: SamplingParams = engine_request.sampling_params
        self.priority = engine_request.priority
        self.arrival_order = arrival_order  # ties between equal priorities
        self.cache_salt = engine_request.cache_salt
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

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        # Hashes cover every full block of known tokens; whether a block may
        # be cached (its KV computed) is the KV cache manager's decision.
        if self._enable_caching:
            extend_block_hashes(self.block_hashes, self.all_token_ids, self._block_size, self.cache_salt)

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
