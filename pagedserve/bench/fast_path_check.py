"""Does the fast path compute the same function? (`pagedserve bench accuracy`)

Three checks on a workload, each between two engines that differ in one thing:
1. float32, compiled vs eager: share of greedy tokens that agree (position by
   position, every request);
2. bfloat16, compiled vs eager: relative L2 error of the first step's logits
   (every prompt's last position);
3. bfloat16 (compiled) vs float32 (eager): share of prompts whose first greedy
   token agrees.

Opt-in (`--checks quantized`): the quantized kernels against their dequantized reference, at the
command's --dtype and --quantization, both compiled: greedy tokens that agree and requests identical
throughout. `gguf`: against `--quantization none` (the same weights dequantized to --dtype);
`int8`: against the same W8A8 function in plain PyTorch (PAGEDSERVE_INT8_KERNEL=0).

Opt-in (`--checks kv_cache_bfloat16`): what `--kv-cache-dtype bfloat16` costs a
float32 model, both compiled: greedy tokens that agree with the float32 cache's,
requests identical throughout, and the first step's logits' relative L2 error.
"""
from __future__ import annotations

import gc
import os
from typing import Any
from unittest import mock

from pagedserve.bench.workloads import BenchRequest
from common.config import EngineConfig


ACCURACY_CHECKS = ("float32", "bfloat16", "first_token", "kv_cache_bfloat16", "quantized")


def _engine(config: EngineConfig, dtype: str, eager: bool, **changes: Any):
    from pagedserve.offline.llm import LLM
    return LLM.from_config(config.replace(dtype=dtype, enforce_eager=eager, **changes), skip_tokenizer_init=True)


def greedy_tokens(llm: Any, requests: list[BenchRequest], max_tokens: int | None = None) -> list[list[int]]:
    from pagedserve.bench.throughput import greedy_params
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [greedy_params(max_tokens or r.max_tokens) for r in requests]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def first_step_logits(llm: Any, requests: list[BenchRequest]):
    """Logits at each prompt's last position, each prompt prefilled alone in a fresh cache."""
    import torch

    from common.protocol import NewRequestData, StepPlan
    from pagedserve.bench.throughput import greedy_params

    worker = llm.worker
    rows = []
    for i, request in enumerate(requests):
        ids = list(request.prompt_token_ids)
        blocks = list(range(1, 1 + -(-len(ids) // worker.config.block_size)))
        plan = StepPlan(step_id=i, new_requests=[NewRequestData(
            request_id=f"logits-{i}", token_ids=ids, num_prompt_tokens=len(ids), sampling_params=greedy_params(1),
            block_ids=blocks, num_computed_tokens=0)], num_scheduled_tokens={f"logits-{i}": len(ids)})
        worker.input_batch.apply_plan(plan)
        batch = worker.input_batch.build(plan.num_scheduled_tokens)
        with torch.inference_mode():
            hidden = worker.forward(batch.input_ids, batch.positions, batch.attn_metadata)
            rows.append(worker.lm_head.logits(hidden.index_select(0, batch.logits_indices)))
        worker.input_batch.apply_plan(StepPlan(step_id=i, finished_request_ids=[f"logits-{i}"]))
    return torch.cat(rows)


def relative_l2(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run_accuracy(config: EngineConfig, requests: list[BenchRequest], *, max_tokens: int | None = None,
                 checks: tuple[str, ...] = ("float32", "bfloat16", "first_token")) -> dict[str, Any]:
    result: dict[str, Any] = {"requests": len(requests)}
    fp32_eager = None
    if "float32" in checks or "first_token" in checks:
        fp32_eager = _engine(config, "float32", eager=True)
    if "float32" in checks:
        eager = greedy_tokens(fp32_eager, requests, max_tokens)
        compiled = greedy_tokens(_engine(config, "float32", eager=False), requests, max_tokens)
        pairs = [(a, b) for x, y in zip(eager, compiled) for a, b in zip(x, y)]
        result["float32_compiled_vs_eager_token_agreement"] = round(sum(a == b for a, b in pairs) / len(pairs), 5)
        result["float32_identical_requests"] = sum(x == y for x, y in zip(eager, compiled))
    bf16_compiled = None
    if "bfloat16" in checks or "first_token" in checks:
        bf16_compiled = _engine(config, "bfloat16", eager=False)
    if "bfloat16" in checks:
        compiled_logits = first_step_logits(bf16_compiled, requests)
        eager_logits = first_step_logits(_engine(config, "bfloat16", eager=True), requests)
        result["bfloat16_compiled_vs_eager_logits_rel_l2"] = round(relative_l2(compiled_logits, eager_logits), 6)
    if "first_token" in checks:
        bf16_first = [t[0] for t in greedy_tokens(bf16_compiled, requests, 1)]
        fp32_first = [t[0] for t in greedy_tokens(fp32_eager, requests, 1)]
        result["bfloat16_vs_float32_first_token_agreement"] = round(
            sum(a == b for a, b in zip(bf16_first, fp32_first)) / len(requests), 5)
    if "kv_cache_bfloat16" in checks:
        fp32_eager = bf16_compiled = None
        gc.collect()  # each engine holds its own KV cache
        result.update(_kv_cache_check(config, requests, max_tokens))
    if "quantized" in checks:
        fp32_eager = bf16_compiled = None
        gc.collect()
        result.update(_quantized_check(config, requests, max_tokens))
    return result


def _quantized_check(config: EngineConfig, requests: list[BenchRequest], max_tokens: int | None) -> dict[str, Any]:
    from worker.quantization.int8_weights import KERNEL_SWITCH

    llm = _engine(config, config.dtype, config.enforce_eager)
    method = llm.worker.quantization
    if method not in ("gguf", "int8"):
        raise ValueError(f"--checks quantized needs --quantization gguf or int8 (this model runs {method!r})")
    quantized = greedy_tokens(llm, requests, max_tokens)
    del llm
    gc.collect()
    if method == "gguf":
        reference = greedy_tokens(_engine(config, config.dtype, config.enforce_eager, quantization="none"), requests,
                                  max_tokens)
    else:
        with mock.patch.dict(os.environ, {KERNEL_SWITCH: "0"}):
            reference = greedy_tokens(_engine(config, config.dtype, config.enforce_eager, quantization="int8"),
                                      requests, max_tokens)
    pairs = [(a, b) for x, y in zip(quantized, reference) for a, b in zip(x, y)]
    return {"quantization": method,
            f"{method}_vs_reference_token_agreement": round(sum(a == b for a, b in pairs) / len(pairs), 5),
            f"{method}_identical_requests": sum(x == y for x, y in zip(quantized, reference))}


def _kv_cache_check(config: EngineConfig, requests: list[BenchRequest], max_tokens: int | None) -> dict[str, Any]:
    outputs = {}
    for kv_cache_dtype in ("auto", "bfloat16"):
        llm = _engine(config, "float32", eager=False, kv_cache_dtype=kv_cache_dtype)
        outputs[kv_cache_dtype] = greedy_tokens(llm, requests, max_tokens), first_step_logits(llm, requests)
        del llm
        gc.collect()
    (full_tokens, full_logits), (halved_tokens, halved_logits) = outputs["auto"], outputs["bfloat16"]
    pairs = [(a, b) for x, y in zip(full_tokens, halved_tokens) for a, b in zip(x, y)]
    return {"kv_bfloat16_vs_float32_token_agreement": round(sum(a == b for a, b in pairs) / len(pairs), 5),
            "kv_bfloat16_identical_requests": sum(x == y for x, y in zip(full_tokens, halved_tokens)),
            "kv_bfloat16_vs_float32_logits_rel_l2": round(relative_l2(halved_logits, full_logits), 6)}
