"""The worker for BERT-style encoders: whole prompts, bidirectional attention, no KV cache.

It speaks the same plans and results as `worker.worker.Worker`, so the scheduler, the
offline LLM and the worker process drive it unchanged. The scheduler still counts KV
blocks for its requests: this worker announces just enough of them for one step's token
budget (they hold nothing), and the scheduler, told the pooler is bidirectional, neither
chunks a prompt nor serves one from the prefix cache. Every scheduled request runs its
whole prompt in one step and returns its pooled vector.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from common.config import EngineConfig
from common.errors import ConfigError
from common.protocol import StepPlan, StepResult, WorkerHello
from common.sampling_params import SamplingParams
from common.tokenizer import eos_token_ids
from worker.input_batch import RequestState
from worker.model_loader import iterate_weights, load_hf_config, safetensors_files
from worker.models.bert import BertModel, load_bert_weights
from worker.pooler import pool_step, pooler_info

logger = logging.getLogger(__name__)


class EncoderWorker:
    def __init__(self, config: EngineConfig, rank: int = 0):
        if config.world_size > 1:
            raise ConfigError("an encoder model runs on one worker rank: tensor_parallel_size and "
                              "pipeline_parallel_size must be 1")
        self.config = config
        self.rank = rank
        self.device = torch.device(config.resolved_device())
        self.dtype_name = config.resolved_dtype()
        self.dtype = getattr(torch, self.dtype_name)
        self.hf_config, self.model_dir = load_hf_config(config)
        self.pooler = pooler_info(config, self.model_dir, self.hf_config)
        if self.pooler is None:
            raise ConfigError(f"{config.model} is an encoder: it serves embeddings only (runner 'pooling')")
        torch.manual_seed(config.seed)
        self.model = BertModel(self.hf_config, dtype=self.dtype, device=self.device)
        load_bert_weights(self.model, iterate_weights(safetensors_files(self.model_dir)))
        self.model.eval()
        limit = int(self.hf_config.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ConfigError(f"max_model_len {config.max_model_len} is more than the model's "
                              f"max_position_embeddings ({limit})")
        self.max_model_len = config.max_model_len or limit
        # Bookkeeping blocks only: a step's whole prompts, each rounded up to a block.
        budget = max(config.resolved_max_num_batched_tokens(), self.max_model_len)
        self.num_blocks = 1 + config.max_num_seqs + -(-budget // config.block_size)
        self.requests: dict[str, RequestState] = {}
        logger.info("Encoder worker ready: %s on %s (%s), max_model_len %d, pooling %s%s", config.model,
                    self.device, self.dtype_name, self.max_model_len, self.pooler.pooling_type,
                    " normalised" if self.pooler.normalize else "")

    def hello(self) -> WorkerHello:
        return WorkerHello(
            rank=self.rank, model_name=self.config.model, num_blocks=self.num_blocks,
            block_size=self.config.block_size, max_model_len=self.max_model_len,
            vocab_size=int(self.hf_config.vocab_size), eos_token_ids=eos_token_ids(self.model_dir),
            dtype=self.dtype_name, pooler=self.pooler)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def reset_requests(self) -> None:
        self.requests.clear()

    def execute(self, plan: StepPlan) -> StepResult:
        """Run each scheduled request's whole prompt; return the vectors."""
        started = time.perf_counter_ns()
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            if new.pooling_params is None:
                raise ValueError(f"request {new.request_id!r}: an encoder serves pooling requests only")
            self.requests[new.request_id] = RequestState(
                request_id=new.request_id, token_ids=list(new.token_ids), num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=SamplingParams(), block_ids=[], num_computed_tokens=0,
                pooling_params=new.pooling_params)
        scheduled = [(self._state(rid), n) for rid, n in plan.num_scheduled_tokens.items() if n > 0]
        pooled: dict[str, list[float]] = {}
        if scheduled:
            for state, n in scheduled:
                if state.num_computed_tokens != 0 or n != state.num_prompt_tokens:
                    raise ValueError(f"request {state.request_id!r}: an encoder runs whole prompts, but "
                                     f"{n} of {state.num_prompt_tokens} tokens were scheduled")
            pooled = self._run(scheduled)
            for state, _ in scheduled:
                self.requests.pop(state.request_id, None)  # done: its vector goes back now
        return StepResult(step_id=plan.step_id, request_ids=[], sampled_token_ids=[], pooled=pooled,
                          execute_ns=time.perf_counter_ns() - started)

    def _run(self, scheduled: list[tuple[RequestState, int]]) -> dict[str, list[float]]:
        seq_lens = [n for _, n in scheduled]
        ids = torch.tensor([t for state, _ in scheduled for t in state.token_ids], dtype=torch.long)
        positions = torch.cat([torch.arange(n, dtype=torch.long) for n in seq_lens])
        with torch.inference_mode():
            hidden = self.model(ids.to(self.device), positions.to(self.device), seq_lens)
            starts, entries = 0, []
            for state, n in scheduled:
                entries.append((state, starts, n))
                starts += n
            return pool_step(entries, hidden)

    def _state(self, request_id: str) -> RequestState:
        state = self.requests.get(request_id)
        if state is None:
            raise KeyError(f"scheduled request {request_id!r} is unknown to the worker")
        return state


def make_worker(config: EngineConfig, rank: int = 0) -> Any:
    """The worker for `config.model`: an EncoderWorker for BERT-style encoders, else a Worker."""
    from common.pooling_params import is_encoder_config

    hf_config, _ = load_hf_config(config)
    if is_encoder_config(hf_config):
        return EncoderWorker(config, rank)
    from worker.worker import Worker

    return Worker(config, rank)
