"""The transformers baseline: `generate` on static batches, same model and dtype.

Requests are grouped by output length (all of W1 or W2 share one), then cut
into batches of `batch_size` (default: the whole group, one static batch).
Prompts are left-padded with an attention mask; every row generates exactly max_tokens greedy tokens (no EOS stop), so the
output token count equals pagedserve's and vLLM's for the same workload.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from pagedserve.bench.workloads import BenchRequest, workload_summary


def run_transformers(model_dir: str, requests: list[BenchRequest], *, dtype: str = "bfloat16",
                     batch_size: int | None = None, workload_name: str = "") -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from worker.worker import available_cpu_count

    torch.set_num_threads(available_cpu_count())
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, local_files_only=True).eval()
    pad_id = 0
    model.generation_config.pad_token_id = pad_id
    model.generation_config.eos_token_id = None  # ignore_eos: every row runs to max_new_tokens

    batches = static_batches(requests, batch_size)
    generate_batch(model, [BenchRequest(requests[0].prompt_token_ids[:8], 2)], pad_id)  # warm-up
    started = time.perf_counter()
    output_tokens = sum(generate_batch(model, batch, pad_id) for batch in batches)
    elapsed = time.perf_counter() - started
    summary = workload_summary(requests)
    return {
        "system": "transformers",
        "version": transformers.__version__,
        "workload": workload_name,
        **summary,
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 6),  # microseconds: a tiny run takes only milliseconds
        "output_tokens_per_s": round(output_tokens / elapsed, 2),
        "total_tokens_per_s": round((output_tokens + summary["prompt_tokens"]) / elapsed, 2),
        "dtype": dtype,
        "batches": len(batches),
        "threads": torch.get_num_threads(),
    }


def static_batches(requests: list[BenchRequest], batch_size: int | None) -> list[list[BenchRequest]]:
    by_length: dict[int, list[BenchRequest]] = defaultdict(list)
    for request in requests:
        by_length[request.max_tokens].append(request)
    batches = []
    for group in by_length.values():
        size = batch_size or len(group)
        batches += [group[i:i + size] for i in range(0, len(group), size)]
    return batches


def generate_batch(model: Any, batch: list[BenchRequest], pad_id: int, device: Any = "cpu") -> int:
    """Greedy generation for one static batch on `device`; returns the number of new tokens."""
    import torch

    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        ids = request.prompt_token_ids
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    new_tokens = batch[0].max_tokens
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    generated = out.shape[1] - width
    if generated != new_tokens:
        raise RuntimeError(f"transformers generated {generated} tokens per row, expected {new_tokens}")
    return generated * len(batch)
