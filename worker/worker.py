"""The model worker: owns the model, the KV cache and per-request state, and
executes the scheduler's step plans."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch

from common.config import EngineConfig
from common.errors import ConfigError
from common.model_files import local_model_source
from common.parallel_layout import check_model_layout
from common.lora_request import LoRARequest
from common.protocol import StepPlan, StepResult, WorkerHello
from common.tokenizer import eos_token_ids
from worker.attention import get_attention_backend
from worker.attention.fp8_kv import is_fp8, kv_cache_torch_dtype
from worker.compiled_forward import ModelForward, inductor_available
from worker.cuda_graphs import with_decode_graphs
from worker.cuda_memory_profiling import cuda_memory_profile
from worker.heap_tuning import keep_freed_memory_mapped
from worker.lora_slots import LoRAAdapterError, LoRASlots
from worker.input_batch import InputBatch
from worker.kv_cache import allocate_kv_caches, copy_block_prefixes, kv_cache_spec, num_blocks_for
from worker.kv_scales import read_kv_scales
from worker.distributed.cpu_binding import bind_rank_cores
from worker.distributed.parallel_state import group_minimum, init_worker_group
from worker.lm_head import LmHead, choose_lm_head
from worker.lm_head.vocab_parallel import VocabParallelLmHead
from worker.lm_head.final_softcap import with_final_softcap
from worker.model_loader import load_model, safetensors_files
from worker.model_runner import ModelRunner
from worker.pooler import pooler_info
from worker.quantization import prepare_linear_weights
from worker.models.rotary import CONTEXT_STRETCHING_ROPE_TYPES, rope_parameters
from worker.spec_decode.draft_model_proposer import DraftModelProposer
from worker.spec_decode.speculator import Speculator
from worker.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)


def available_cpu_count() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0):
        self.model_name = config.model  # as given (a Hub id stays one in what we report)
        config = local_model_source(config)  # a Hub model: its local snapshot from here on
        self.config = config
        self.rank = rank
        self.device = torch.device(config.resolved_device())
        if self.device.type == "cpu":
            bind_rank_cores()  # a group's ranks on one host: each its share of the cores
        elif config.world_size > 1:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.set_num_threads(available_cpu_count())
        check_model_layout(config)
        self.layout = init_worker_group(config, rank, self.device)
        self.dtype_name = config.resolved_dtype()
        self.dtype: torch.dtype = getattr(torch, self.dtype_name)
        self.kv_cache_dtype_name = config.resolved_kv_cache_dtype()
        self.kv_cache_dtype: torch.dtype = kv_cache_torch_dtype(self.kv_cache_dtype_name)

        self.model, self.hf_config, self.model_dir = load_model(config, self.device, self.dtype, self.layout)
        self.pooler = pooler_info(config, self.model_dir, self.hf_config)  # refuses a runner the model cannot run
        self.quantization = prepare_linear_weights(self.model, config)
        compile_step = not config.enforce_eager  # the model step; the lm_head's scan on CPU only
        self.lm_head = self._lm_head(compile_step and self.device.type == "cpu")
        if self.device.type == "cpu":  # after loading, whose temporary copies may go back to the kernel
            keep_freed_memory_mapped()  # steps then reuse their activations' pages instead of faulting them in
        spec = kv_cache_spec(self.hf_config, config.block_size, self.kv_cache_dtype,
                             num_layers=len(self.model.layers), num_kv_heads=self.model.sizes.num_kv_heads)
        # A draft model's cache has the same blocks: each block's bytes count both.
        self.draft_model = self._draft_model()
        sizing = spec if self.draft_model is None else dataclasses.replace(
            spec, num_layers=spec.num_layers + self._draft_layers_equivalent(spec))
        self.backend = get_attention_backend(config.resolved_attention_backend())
        profile = cuda_memory_profile(config, self.model, self.lm_head, self.backend, spec, self.device,
                                      self.layout.world_size)  # None on CPU
        # The same block ids on every rank.
        self.num_blocks = group_minimum(num_blocks_for(config, sizing, self.device, profile))
        model_limit = _model_max_len(self.hf_config)
        self.max_model_len = config.resolve_max_model_len(model_limit=model_limit, num_blocks=self.num_blocks,
                                                          sliding_window=self.shared_sliding_window())
        if self.max_model_len < model_limit and config.max_model_len is None:
            logger.warning("max_model_len is %d, not the model's %d: that is all the KV cache holds "
                           "(%d blocks of %d tokens); raise --kv-cache-memory to serve longer sequences",
                           self.max_model_len, model_limit, self.num_blocks, config.block_size)
        self.kv_caches = allocate_kv_caches(self.hf_config, self.num_blocks, config.block_size, self.kv_cache_dtype,
                                            self.device, max_model_len=self.max_model_len, spec=spec)
        # An 8-bit cache's per-layer scales (this rank's layers); other caches have none.
        self.kv_scales = read_kv_scales(safetensors_files(self.model_dir), range(
            self.model.first_layer, self.model.end_layer)) if is_fp8(self.kv_cache_dtype) else None
        eos_ids = eos_token_ids(self.model_dir)
        self.grammar_compiler = GrammarCompiler(config.tokenizer or self.model_dir, int(self.hf_config.vocab_size),
                                                eos_ids)
        self.grammar_compiler.start_warm_up()  # alongside the model's warm-up, which leaves a core mostly idle
        # Multi-LoRA: adapter slots on the layers before the step is compiled (worker.lora_slots).
        self.lora = (LoRASlots(self.model, config.max_loras, config.resolved_max_cpu_loras(), config.max_lora_rank)
                     if config.enable_lora else None)
        self.forward = ModelForward(self.model, self.kv_caches, self.backend, max_model_len=self.max_model_len,
                                    compile=compile_step, kv_scales=self.kv_scales)
        self.forward.warm_up(config.block_size)
        if self.draft_model is not None:
            self.draft_model.allocate(self.num_blocks, self.max_model_len, self.backend)
        speculator = (Speculator(config.speculative_config, self.draft_model)
                      if config.speculative_config is not None else None)
        # CUDA: decode steps replay CUDA graphs; elsewhere this is self.forward itself.
        step_forward = with_decode_graphs(self.forward, config, backend_name=config.resolved_attention_backend(),
                                          max_model_len=self.max_model_len, device=self.device,
                                          world_size=self.layout.world_size)
        self.runner = ModelRunner(self.model, self.lm_head, self.kv_caches, self.backend, config.block_size,
                                  self.device, seed=config.seed, forward=step_forward, speculator=speculator)
        started = time.perf_counter()
        self.runner.warm_up()
        if self.forward.compiled:
            self.forward.compile_seconds += time.perf_counter() - started  # reported with the step's
        self.input_batch = InputBatch(config.block_size, self.device, eos_token_ids=eos_ids,
                                      grammar_compiler=self.grammar_compiler,
                                      mrope_merge_size=getattr(self.model, "mrope_merge_size", 0))
        logger.info("Worker %s ready: %s on %s (%s, quantization %s, %s), %d KV blocks, max_model_len %d, %d threads",
                    self.layout.describe() if self.layout.world_size > 1 else rank, config.model, self.device, self.dtype_name if self.kv_cache_dtype == self.dtype
                    else f"{self.dtype_name}, KV cache {self.kv_cache_dtype_name}", self.quantization,
                    f"compiled in {self.forward.compile_seconds:.1f} s" if self.forward.compiled else "eager",
                    self.num_blocks, self.max_model_len, torch.get_num_threads())

    def _draft_model(self) -> DraftModelProposer | None:
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        if getattr(self.model, "mrope_merge_size", 0):  # its steps' positions are the target's 3-D ones
            raise ConfigError(f"a draft model cannot run beside {type(self.model).__name__} (M-RoPE positions); "
                              "use ngram speculation")
        # An 8-bit target cache's scales are the target's: the draft keeps its cache in the model dtype.
        kv_dtype = self.dtype if is_fp8(self.kv_cache_dtype) else self.kv_cache_dtype
        return DraftModelProposer(self.config, self.device, self.dtype, kv_dtype, int(self.hf_config.vocab_size))

    def _draft_layers_equivalent(self, spec) -> int:
        """The draft cache's bytes per block, in target layers (rounded up)."""
        per_layer = spec.bytes_per_block // spec.num_layers
        return -(-self.draft_model.kv_spec().bytes_per_block // per_layer)

    def _lm_head(self, compile_step: bool) -> LmHead | None:
        """The lm_head strategy on the last pipeline stage (None elsewhere); under tensor
        parallelism over this rank's share of the vocabulary."""
        if self.model.lm_head is None:
            return None
        head = choose_lm_head(self.model.lm_head, rescore_near_ties=self.config.greedy_rescore_near_ties
                              and self.layout.tp_size == 1, compile_scan=compile_step and inductor_available())
        if self.layout.tp_size > 1:
            s = self.model.sizes
            head = VocabParallelLmHead(head, s.vocab, s.vocab_start, s.vocab_real_rows)
        # Outermost: the whole (gathered) vocabulary's logits are capped (Gemma).
        return with_final_softcap(head, getattr(self.model, "final_logit_softcapping", None))

    def hello(self) -> WorkerHello:
        return WorkerHello(
            rank=self.rank, model_name=self.model_name, num_blocks=self.num_blocks,
            block_size=self.config.block_size, max_model_len=self.max_model_len,
            vocab_size=int(self.hf_config.vocab_size), eos_token_ids=eos_token_ids(self.model_dir),
            dtype=self.dtype_name, tensor_parallel_size=self.layout.tp_size,
            pipeline_parallel_size=self.layout.pp_size, sliding_window=self.shared_sliding_window(),
            pooler=self.pooler)

    def shared_sliding_window(self) -> int:
        """The window every layer of every model sharing the KV blocks (a draft model too) keeps
        to, or 0 when some layer sees the whole sequence: blocks before it can be given back."""
        windows = list(getattr(self.model, "sliding_windows", None) or [None])
        if self.draft_model is not None:
            windows += list(getattr(self.draft_model.model, "sliding_windows", None) or [None])
        return 0 if any(not w for w in windows) else max(windows)

    @property
    def num_requests(self) -> int:
        return len(self.input_batch)

    def reset_requests(self) -> None:
        """Forget every request (their scheduler is gone); the KV cache is simply overwritten later."""
        self.input_batch.requests.clear()

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the plan's diffs, run the scheduled tokens, return the sampled ids.

        A plan with nothing scheduled (only finished ids) just updates state.
        """
        started = time.perf_counter_ns()
        if plan.kv_copies:
            copy_block_prefixes(self.kv_caches, plan.kv_copies)
            if self.draft_model is not None:
                copy_block_prefixes(self.draft_model.kv_caches, plan.kv_copies)
        self.input_batch.apply_plan(plan)
        failed = self._drop_unusable_adapters(plan.num_scheduled_tokens) if self.lora is not None else {}
        scheduled = ({r: n for r, n in plan.num_scheduled_tokens.items() if r not in failed} if failed
                     else plan.num_scheduled_tokens)
        batch = self.input_batch.build(scheduled, plan.draft_token_ids)
        if batch is None:
            return StepResult(step_id=plan.step_id, request_ids=[], sampled_token_ids=[],
                              execute_ns=time.perf_counter_ns() - started, failed=failed)
        if self.lora is None:
            output = self.runner.execute(batch, speculate=plan.speculate)
        else:
            with self.lora.step(batch.scheduled):
                output = self.runner.execute(batch, speculate=plan.speculate)
        return StepResult(step_id=plan.step_id, request_ids=output.request_ids,
                          sampled_token_ids=output.sampled_token_ids, execute_ns=time.perf_counter_ns() - started,
                          sampled_logprobs=output.sampled_logprobs, prompt_logprobs=output.prompt_logprobs,
                          accepted_draft_ids=output.accepted_draft_ids, draft_logprobs=output.draft_logprobs,
                          proposals=output.proposals, pooled=output.pooled, failed=failed)

    def _drop_unusable_adapters(self, scheduled: dict[str, int]) -> dict[str, str]:
        """Load the adapters of the scheduled requests before the step (a no-op for loaded ones);
        a request whose adapter cannot be loaded (shapes that do not fit the model, files changed
        or gone) is dropped here and returned with the reason, for the scheduler to fail with a 400:
        an adapter never takes the worker, or the rest of the step, down."""
        failed: dict[str, str] = {}
        errors: dict[LoRARequest, str | None] = {}  # each adapter once per step
        for request_id in scheduled:
            state = self.input_batch.requests.get(request_id)
            lora = None if state is None else state.lora_request
            if lora is None:
                continue
            if lora not in errors:
                errors[lora] = None
                try:
                    self.lora.load(lora)
                except LoRAAdapterError as e:
                    errors[lora] = str(e)
                except Exception as e:  # whatever else reading the files raised
                    logger.exception("loading LoRA adapter %r failed", lora.lora_name)
                    errors[lora] = f"LoRA adapter {lora.lora_name!r} cannot be loaded: {type(e).__name__}: {e}"
            if errors[lora] is not None:
                failed[request_id] = errors[lora]
        for request_id in failed:
            del self.input_batch.requests[request_id]
        return failed


def _model_max_len(hf_config: Any) -> int:
    """The longest sequence the model supports: max_position_embeddings, times the
    factor of a RoPE scaling that stretches the context beyond it (linear, dynamic
    NTK), as vLLM derives it. llama3 scaling already counts in the config's value."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if not limit:
        raise ValueError("the model config has no max_position_embeddings; set max_model_len")
    rope = rope_parameters(hf_config)
    if rope["rope_type"] in CONTEXT_STRETCHING_ROPE_TYPES:
        limit *= float(rope.get("factor") or 1.0)
    return int(limit)
