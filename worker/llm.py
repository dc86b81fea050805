"""Offline inference: the scheduler and one worker in a single process, no sockets.

    llm = LLM(model="smollm2-135m-instruct", dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from tqdm.auto import tqdm

from common.config import EngineConfig
from common.errors import InvalidRequestError
from common.protocol import EngineRequest, FinishReason
from common.sampling_params import SamplingParams
from common.tokenizer import apply_chat_template, load_tokenizer
from scheduler.scheduler import Scheduler
from worker.worker import Worker

PromptInput = Union[str, list[int], dict]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort"


@dataclass(slots=True)
class GenerationOutput:
    """One prompt's result, shaped like vLLM's RequestOutput."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = True
    metrics: dict[str, float] = field(default_factory=dict)


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", skip_tokenizer_init: bool = False,
                 **engine_args: Any):
        """`skip_tokenizer_init=True` serves models without tokenizer files:
        prompts must then be token ids and outputs carry ids but no text."""
        self.config = EngineConfig(model=model, **engine_args)
        self.worker = Worker(self.config)
        hello = self.worker.hello()
        self.max_model_len = hello.max_model_len
        self.scheduler = Scheduler(self.config, num_blocks=hello.num_blocks,
                                   max_model_len=hello.max_model_len, eos_token_ids=list(hello.eos_token_ids))
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(self.worker.model_dir)
        self._ids = itertools.count()

    # --- public API -------------------------------------------------------
    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[GenerationOutput]:
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        encoded = [self._encode(p) for p in prompt_list]
        return self._run(encoded, params_list, use_tqdm)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[GenerationOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": apply_chat_template(
            self.tokenizer, conv, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)}
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    # --- internals ------------------------------------------------------------
    def _encode(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("text prompts need a tokenizer (skip_tokenizer_init is set)", param="prompts")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._encode(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompts")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}", param="prompts")

    def _run(self, encoded: list[tuple[str | None, list[int]]], params_list: list[SamplingParams],
             use_tqdm: bool) -> list[GenerationOutput]:
        results: dict[str, GenerationOutput] = {}
        order: list[str] = []
        for (text, token_ids), params in zip(encoded, params_list):
            request_id = str(next(self._ids))
            params.validate()
            # Raises InvalidRequestError (e.g. prompt too long) before any work starts.
            self.scheduler.add_request(EngineRequest(request_id=request_id, prompt_token_ids=token_ids,
                                                     sampling_params=params, arrival_time=time.time()))
            order.append(request_id)
            results[request_id] = GenerationOutput(request_id, text, token_ids,
                                                   [CompletionOutput(0, "", [], None)], finished=False)
        bar = tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        started, generated = time.perf_counter(), 0
        try:
            while self.scheduler.has_unfinished_requests():
                plan = self.scheduler.schedule()
                if plan is None:
                    continue
                outputs = self.scheduler.update(plan, self.worker.execute(plan))
                for out in outputs:
                    result = results[out.request_id]
                    completion = result.outputs[0]
                    completion.token_ids.extend(out.new_token_ids)
                    generated += len(out.new_token_ids)
                    result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
                    if out.finish_reason is not None:
                        completion.finish_reason = FinishReason(out.finish_reason).openai_name
                        result.finished = True
                        bar.update(1)
                        bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - started):.1f}")
        except BaseException:
            self.scheduler.abort_requests([r for r in order if not results[r].finished])
            raise
        finally:
            bar.close()
        if self.tokenizer is not None:
            for result in results.values():
                completion = result.outputs[0]
                completion.text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        return [results[r] for r in order]


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _broadcast_params(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError(f"got {len(params)} sampling params for {n} prompts", param="sampling_params")
    return params
