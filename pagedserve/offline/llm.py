"""Offline inference: the scheduler and one worker in a single process, no sockets.

    llm = LLM(model="smollm2-135m-instruct", dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""
from __future__ import annotations

import itertools
import time
import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Sequence, Union

from tqdm.auto import tqdm

from common.bad_words import with_bad_words_tokenized
from common.beam_search import BeamSearchParams
from common.config import EngineConfig
from common.errors import InvalidRequestError
from common.generation_defaults import sampling_defaults
from common.model_files import local_model_source
from common.pooling_params import PoolingParams
from common.prompt_truncation import truncate_prompt
from common.lora_request import LoRARequest
from common.protocol import EngineRequest, ImageInput
from common.sampling_params import SamplingParams
from common.structured_outputs import check_grammar
from common.tokenizer import apply_chat_template, load_tokenizer
from scheduler.scheduler import Scheduler
from pagedserve.offline.offline_beam_search import run_beam_search
from pagedserve.offline.offline_embed import EmbeddingRequestOutput, run_embed
from pagedserve.offline.offline_images import chat_image_prompt, has_image_parts, prompt_images
from pagedserve.offline.offline_outputs import CompletionOutput, GenerationOutput, OfflineRequest
from pagedserve.offline.data_parallel import ReplicaProcesses, run_sharded
from pagedserve.offline.follower_ranks import FollowerRanks
from worker.distributed.group_leader import GroupLeader
from worker.distributed.parallel_state import close_worker_group
from common.parallel_layout import check_model_layout
from worker.encoder_worker import make_worker

__all__ = ["LLM", "LoRARequest", "BeamSearchParams", "CompletionOutput", "GenerationOutput"]

PromptInput = Union[str, list[int], dict]


@dataclass(slots=True)
class EngineLoopStats:
    """Where the offline loop's time went during the last `generate` call."""
    steps: int = 0
    scheduled_tokens: int = 0
    schedule_ns: int = 0  # Scheduler.schedule
    update_ns: int = 0  # Scheduler.update (applying sampled tokens, finishing requests)
    execute_ns: int = 0  # Worker.execute (input prep, model, sampling)
    outputs_ns: int = 0  # turning outputs into results (detokenization, stop strings)
    peak_used_blocks: int = 0  # KV blocks held by requests at the fullest step
    itl_s: list[float] = field(default_factory=list)  # per token, when LLM.record_itl (InterTokenLatency)

    @property
    def scheduler_ms_per_step(self) -> float:
        return (self.schedule_ns + self.update_ns) / 1e6 / max(self.steps, 1)


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", skip_tokenizer_init: bool = False,
                 generation_config: str = "auto", **engine_args: Any):
        """`skip_tokenizer_init=True` serves models without tokenizer files:
        prompts must then be token ids and outputs carry ids but no text.
        `generation_config`: where `get_default_sampling_params` (used when
        generate gets none) finds the model's sampling defaults, as vLLM's.
        `model` may be a Hub id, ORG/NAME[@REVISION] (with `revision=`, `gguf_file=`):
        fetched once here, and every rank and replica loads that snapshot."""
        self.config = local_model_source(EngineConfig(model=model, **engine_args))
        self.replicas = None  # data-parallel replicas 1.., as child processes
        if self.config.data_parallel_size > 1:
            check_model_layout(self.config)
            self.replicas = ReplicaProcesses(self.config, skip_tokenizer_init)
            self.config = self.config.replace(data_parallel_size=1)
        self.followers = None  # ranks 1.. of a tensor/pipeline-parallel group, as child processes
        if self.config.world_size > 1:
            check_model_layout(self.config)
            self.followers = FollowerRanks(self.config)
            self.config = self.followers.config
        try:
            self.worker = make_worker(self.config)  # a BERT-style encoder gets the encoder worker
        except BaseException:
            if self.followers is not None:
                self.followers.stop(timeout_s=0)
                close_worker_group()
            if self.replicas is not None:
                self.replicas.stop()
            raise
        self.group = GroupLeader(self.worker)
        # Stops the other ranks when this engine is collected or the program exits (their
        # rank 0 gone, they would otherwise report a broken group).
        self._stop_group = weakref.finalize(self, _stop_group, self.group, self.followers, self.replicas)
        hello = self.worker.hello()
        self.max_model_len = hello.max_model_len
        self.vocab_size = hello.vocab_size
        self.eos_token_ids = list(hello.eos_token_ids)
        self.scheduler = Scheduler(self.config, num_blocks=hello.num_blocks, max_model_len=hello.max_model_len,
                                   eos_token_ids=list(hello.eos_token_ids), vocab_size=hello.vocab_size,
                                   sliding_window=hello.sliding_window, pooler=hello.pooler)
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(self.config.tokenizer or self.worker.model_dir)
        self._ids = itertools.count()
        self.loop_stats = EngineLoopStats()
        self.record_itl = False  # benchmarks: gather loop_stats.itl_s during generate
        self._sampling_defaults = sampling_defaults(self.worker.model_dir, generation_config)

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor/pipeline-parallel group (a no-op for one worker);
        another engine with a group can then start in this process."""
        self._stop_group()
        self.followers = self.replicas = None

    def get_default_sampling_params(self) -> SamplingParams:
        """The API's defaults, with the model's generation config on top (vLLM's)."""
        return SamplingParams.with_defaults(self._sampling_defaults)

    @classmethod
    def from_config(cls, config: EngineConfig, skip_tokenizer_init: bool = False) -> "LLM":
        """An engine with every setting of `config` (as the CLI builds it)."""
        settings = {f.name: getattr(config, f.name) for f in fields(config)}
        return cls(skip_tokenizer_init=skip_tokenizer_init, **settings)

    # --- public API -------------------------------------------------------
    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[GenerationOutput]:
        """`lora_request`: the adapter of every prompt, or one per prompt (None: the base model)."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = [self._tokenize_bad_words(p.validate(self.vocab_size, self.config.max_logprobs))
                       for p in _broadcast_params(sampling_params, len(prompt_list))]
        with_images = [prompt_images(self, p) for p in prompt_list]  # None: a text-only prompt
        encoded = [self._encode(p) if found is None else found[0] for p, found in zip(prompt_list, with_images)]
        encoded = [(text, ids if found else truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len))
                   for (text, ids), params, found in zip(encoded, params_list, with_images)]
        return self._run(encoded, params_list, use_tqdm, [found[1] if found else [] for found in with_images],
                         self._lora_requests(lora_request, len(prompt_list)))

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> list[GenerationOutput]:
        """`chat_template`: a Jinja template (the text) used instead of the model's, as vLLM's."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        render = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                      chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)
        prompts = [chat_image_prompt(self, conv, **render) if has_image_parts(conv)
                   else {"prompt_token_ids": apply_chat_template(self.tokenizer, conv, **render)}
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: PromptInput | Sequence[PromptInput],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """Each prompt's pooled vector (`outputs.embedding`), as vLLM's; needs a pooling model
        (runner "pooling", or an encoder). `use_tqdm` is accepted for vLLM's signature."""
        return run_embed(self, [self._encode(p) for p in _as_prompt_list(prompts)], pooling_params)

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput],
                    params: BeamSearchParams) -> list[GenerationOutput]:
        """vLLM's beam search: each prompt's `params.beam_width` best sequences, best first."""
        return run_beam_search(self, [self._encode(p) for p in _as_prompt_list(prompts)], params)

    # --- internals ------------------------------------------------------------
    def _tokenize_bad_words(self, params: SamplingParams) -> SamplingParams:
        if params.bad_words and self.tokenizer is None:
            raise InvalidRequestError("bad_words need a tokenizer (skip_tokenizer_init is set)", param="bad_words")
        return with_bad_words_tokenized(params, lambda text: self.tokenizer.encode(text, add_special_tokens=False))

    def _encode(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer (skip_tokenizer_init is set)", param="prompts")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data"):  # generate and chat take them (offline_images), not the others
                raise InvalidRequestError("prompts with images are supported by generate and chat only",
                                          param="prompts")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._encode(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompts")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}", param="prompts")

    def _lora_requests(self, lora_request, count: int) -> list[LoRARequest | None] | None:
        """One adapter (or None) per prompt, each loaded now: a bad adapter fails before any work."""
        if lora_request is None:
            return None
        loras = [lora_request] * count if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(loras) != count:
            raise InvalidRequestError(f"{len(loras)} lora_requests for {count} prompts", param="lora_request")
        if any(lora is not None for lora in loras):
            lora_slots = getattr(self.worker, "lora", None)
            if lora_slots is None or self.replicas is not None:
                raise InvalidRequestError("lora_request needs an LLM made with enable_lora=True (one replica)",
                                          param="lora_request")
            for lora in loras:
                if lora is not None:
                    try:
                        lora_slots.load(lora)
                    except ValueError as e:
                        raise InvalidRequestError(str(e), param="lora_request") from None
        return loras

    def _run(self, encoded: list[tuple[str | None, list[int]]], params_list: list[SamplingParams],
             use_tqdm: bool, images: list[list[ImageInput]] | None = None,
             loras: list[LoRARequest | None] | None = None) -> list[GenerationOutput]:
        for params in params_list:
            params.validate(self.vocab_size, self.config.max_logprobs)
            check_grammar(params.structured_outputs)
        if self.replicas is not None:
            if images and any(images):
                raise InvalidRequestError("image prompts are not supported with data_parallel_size > 1",
                                          param="prompts")
            return run_sharded(self, encoded, params_list, use_tqdm)
        return self._run_here(encoded, params_list, use_tqdm, images=images, loras=loras)

    def _run_here(self, encoded: list[tuple[str | None, list[int]]], params_list: list[SamplingParams],
                  use_tqdm: bool, request_ids: list[str] | None = None,
                  images: list[list[ImageInput]] | None = None,
                  loras: list[LoRARequest | None] | None = None) -> list[GenerationOutput]:
        """Run the prompts on this process's engine (`request_ids`: theirs, else the next ones;
        `images`: each prompt's, see prompt_images)."""
        requests: dict[str, OfflineRequest] = {}
        request_ids = request_ids or [str(next(self._ids)) for _ in encoded]
        images = images or [[] for _ in encoded]
        loras = loras or [None] * len(encoded)
        try:
            for (text, token_ids), params, request_id, prompt_images_, lora in zip(
                    encoded, params_list, request_ids, images, loras):
                # Raises InvalidRequestError (e.g. prompt too long) before any work starts.
                self.scheduler.add_request(EngineRequest(request_id=request_id, prompt_token_ids=token_ids,
                                                         sampling_params=params, arrival_time=time.time(),
                                                         images=prompt_images_, lora_request=lora))
                requests[request_id] = OfflineRequest(request_id, text, token_ids, params, self.tokenizer)
            self._loop(requests, use_tqdm)
        except BaseException:
            self.scheduler.abort_requests([r for r, req in requests.items() if not req.finished])
            raise
        return [req.result for req in requests.values()]

    def _loop(self, requests: dict[str, OfflineRequest], use_tqdm: bool) -> None:
        bar = tqdm(total=len(requests), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        started, generated = time.perf_counter(), 0
        stats = self.loop_stats = EngineLoopStats()
        itl = InterTokenLatency(stats.itl_s) if self.record_itl else None
        clock = time.perf_counter_ns
        try:
            while self.scheduler.has_unfinished_requests():
                t0 = clock()
                plan = self.scheduler.schedule()
                t1 = clock()
                stats.schedule_ns += t1 - t0
                if plan is None:
                    continue
                kv = self.scheduler.stats()  # blocks are fullest right after scheduling
                stats.peak_used_blocks = max(stats.peak_used_blocks, kv.num_total_blocks - kv.num_free_blocks)
                t1 = clock()
                result = self.group.execute(plan)
                if result.failed:  # an adapter that cannot run (checked again when re-read): as a bad one at the start
                    raise InvalidRequestError(next(iter(result.failed.values())), param="lora_request")
                t2 = clock()
                outputs = self.scheduler.update(plan, result)
                t3 = clock()
                stats.execute_ns += t2 - t1
                stats.update_ns += t3 - t2
                stats.steps += 1
                stats.scheduled_tokens += sum(plan.num_scheduled_tokens.values())
                for out in outputs:
                    request = requests[out.request_id]
                    if request.finished:
                        continue
                    generated += len(out.new_token_ids)
                    to_abort = request.add(out)
                    if to_abort:  # stop strings: outputs of the aborted samples are not needed
                        self.scheduler.abort_requests(to_abort)
                    if request.finished:
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - started):.1f}")
                if itl is not None:
                    itl.record(outputs)
                stats.outputs_ns += clock() - t3
        finally:
            bar.close()


class InterTokenLatency:
    """A request's output that brings m tokens after a gap of g seconds (since its previous
    output) counts m gaps of g / m, so speculative steps count per token."""

    def __init__(self, gaps: list[float]):
        self.gaps = gaps
        self.last_output: dict[tuple[str, int], float] = {}

    def record(self, outputs: list) -> None:
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                previous = self.last_output.get((out.request_id, out.index))
                if previous is not None:
                    count = len(out.new_token_ids)
                    self.gaps.extend([(now - previous) / count] * count)
                self.last_output[(out.request_id, out.index)] = now


def _stop_group(group: GroupLeader, followers: FollowerRanks | None, replicas: ReplicaProcesses | None) -> None:
    if replicas is not None:
        replicas.stop()
    if followers is not None:
        group.tell("stop")
        followers.stop()
        close_worker_group()


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _broadcast_params(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError(f"got {len(params)} sampling params for {n} prompts", param="sampling_params")
    return params
