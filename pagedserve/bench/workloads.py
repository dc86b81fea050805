"""Seeded benchmark workloads and their JSONL file format.

A workload is a list of requests, each a prompt of token ids and an exact
output length (every benchmark runs greedy with ignore_eos, so each request
yields exactly `max_tokens` tokens). The named workloads come from the
performance issue:

- W1: 64 requests, prompts of 32-512 random token ids, 128 output tokens;
- W2: 256 requests, prompts of 16-64 random token ids, 256 output tokens;
- S1: one request, a prompt of 128 random token ids, 256 output tokens (single-stream decode);
- L1: long context, 32 requests of 2,048 random token ids, 256 output tokens (the KV cache's
  reads dominate the decode steps: what an 8-bit cache is for);
- P1: prefix-heavy (system prompts, few-shot examples, RAG contexts): 8 groups of
  16 requests, each group's prompts a shared prefix of 1,500 random token ids
  followed by 32-128 of their own, 16-32 output tokens; the groups interleaved;
- C1: copy-heavy real text, 16 chat requests that fix typos in a paragraph or rename
  a function's argument (speculative decoding's case; see `pagedserve.bench.copy_workload`).

A file holds one JSON object a line: {"prompt_token_ids": [...], "max_tokens": N},
the format `vllm_offline_runner.py` reads, so every system runs the
very same prompts.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_requests: int
    min_prompt_len: int
    max_prompt_len: int  # inclusive
    output_len: int


@dataclass(frozen=True, slots=True)
class PrefixWorkloadSpec:
    groups: int
    requests_per_group: int
    prefix_len: int  # shared by a group's prompts
    min_suffix_len: int
    max_suffix_len: int  # inclusive
    min_output_len: int
    max_output_len: int  # inclusive


NAMED_WORKLOADS: dict[str, WorkloadSpec | PrefixWorkloadSpec] = {
    "W1": WorkloadSpec(num_requests=64, min_prompt_len=32, max_prompt_len=512, output_len=128),
    "W2": WorkloadSpec(num_requests=256, min_prompt_len=16, max_prompt_len=64, output_len=256),
    "S1": WorkloadSpec(num_requests=1, min_prompt_len=128, max_prompt_len=128, output_len=256),
    "L1": WorkloadSpec(num_requests=32, min_prompt_len=2048, max_prompt_len=2048, output_len=256),
    "P1": PrefixWorkloadSpec(groups=8, requests_per_group=16, prefix_len=1500, min_suffix_len=32,
                             max_suffix_len=128, min_output_len=16, max_output_len=32),
}
DEFAULT_SEED = 0


def generate_workload(spec: WorkloadSpec, vocab_size: int, seed: int = DEFAULT_SEED) -> list[BenchRequest]:
    """Random prompts from one seeded generator: lengths uniform in
    [min_prompt_len, max_prompt_len], token ids uniform in [0, vocab_size)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    rng = random.Random(seed)
    requests = []
    for _ in range(spec.num_requests):
        length = rng.randint(spec.min_prompt_len, spec.max_prompt_len)
        requests.append(BenchRequest([rng.randrange(vocab_size) for _ in range(length)], spec.output_len))
    return requests


def generate_prefix_workload(spec: PrefixWorkloadSpec, vocab_size: int,
                             seed: int = DEFAULT_SEED) -> list[BenchRequest]:
    """Groups of prompts sharing a random prefix, each with its own random tail and
    output length; the requests shuffled so that the groups arrive interleaved."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    rng = random.Random(seed)
    requests = []
    for _ in range(spec.groups):
        prefix = [rng.randrange(vocab_size) for _ in range(spec.prefix_len)]
        for _ in range(spec.requests_per_group):
            suffix = [rng.randrange(vocab_size) for _ in range(rng.randint(spec.min_suffix_len, spec.max_suffix_len))]
            requests.append(BenchRequest(prefix + suffix, rng.randint(spec.min_output_len, spec.max_output_len)))
    rng.shuffle(requests)
    return requests


def save_workload(requests: list[BenchRequest], path: str) -> None:
    with open(path, "w") as f:
        for request in requests:
            f.write(json.dumps({"prompt_token_ids": request.prompt_token_ids,
                                "max_tokens": request.max_tokens}) + "\n")


def load_workload_file(path: str) -> list[BenchRequest]:
    """Parse a JSONL workload; ValueError names the offending line."""
    requests = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                ids, max_tokens = item["prompt_token_ids"], item["max_tokens"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: expected {{\"prompt_token_ids\": [...], "
                                 f"\"max_tokens\": N}} ({exc})") from None
            if (not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids)
                    or not isinstance(max_tokens, int) or max_tokens < 1):
                raise ValueError(f"{path}:{line_no}: prompt_token_ids must be a non-empty list of "
                                 f"token ids and max_tokens a positive integer")
            requests.append(BenchRequest(ids, max_tokens))
    if not requests:
        raise ValueError(f"{path}: the workload is empty")
    return requests


TEXT_WORKLOADS = ("C1",)  # made of text: their token ids come from a tokenizer


def resolve_workload(name_or_path: str, vocab_size: int, seed: int = DEFAULT_SEED,
                     tokenizer_model: str | None = None, cache_dir: str | None = None) -> list[BenchRequest]:
    """A named workload (W1, W2, S1, L1, P1; case-insensitive) generated for `vocab_size`, C1 with
    the tokenizer of `tokenizer_model` (default: the default model's), or a JSONL file."""
    if name_or_path.upper() == "C1":
        from common.model_files import resolve_model_dir
        from common.tokenizer import load_tokenizer
        from pagedserve.bench.copy_workload import copy_workload_requests
        model_dir = resolve_model_dir(tokenizer_model or "smollm2-135m-instruct", cache_dir)
        return [BenchRequest(ids, n) for ids, n in copy_workload_requests(load_tokenizer(model_dir), seed)]
    spec = NAMED_WORKLOADS.get(name_or_path.upper())
    if isinstance(spec, PrefixWorkloadSpec):
        return generate_prefix_workload(spec, vocab_size, seed)
    if spec is not None:
        return generate_workload(spec, vocab_size, seed)
    if not os.path.isfile(name_or_path):
        raise ValueError(f"unknown workload {name_or_path!r}: use one of "
                         f"{sorted([*NAMED_WORKLOADS, *TEXT_WORKLOADS])} or a JSONL file")
    return load_workload_file(name_or_path)


def workload_summary(requests: list[BenchRequest]) -> dict[str, int]:
    return {"requests": len(requests),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests)}
