"""Logprobs of chosen tokens and their top-k alternatives, from raw logits.

Like vLLM's default, they come from the model's float32 logits before any
penalty, bias, temperature or filter: log_softmax(logits). Sampled tokens
get them from the sampling rows' logits; prompt tokens (prompt_logprobs)
from extra logits computed at the prompt positions of the requests that ask,
so every other request keeps the logits-only-where-sampled fast path.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common.protocol import PromptLogprobs, TokenLogprobs
from worker.kernels import cpu_ops
from worker.lm_head.interface import LmHead

# Prompt positions scored per lm_head call: bounds the [positions, vocab] buffers.
PROMPT_LOGITS_CHUNK = 256
# The kernel keeps its top list by insertion: fine for the usual few, not for --max-logprobs -1's whole vocabulary.
KERNEL_MAX_TOP = 64


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprobs]:
    """For each row of raw logits [N, vocab] (any float dtype): the chosen token's
    logprob and rank, and the row's `num_top[row]` most likely tokens. On CPU the
    kernel extension does it without materializing log_softmax."""
    max_top = min(max(num_top, default=0), logits.shape[1])
    if (max_top <= KERNEL_MAX_TOP and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16)
            and cpu_ops.load() is not None):
        chosen_logprobs, ranks, top_logprobs, top_ids = cpu_ops.token_logprobs_rows(
            logits.contiguous(), chosen.to(torch.int64).contiguous(), max_top)
        return _entries(chosen.tolist(), chosen_logprobs.tolist(), ranks.tolist(), top_ids.tolist(),
                        top_logprobs.tolist(), num_top)
    return select_logprobs(logits.float().log_softmax(dim=-1), chosen, num_top)


def select_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprobs]:
    """`token_logprobs` on rows that are already log-softmaxed."""
    chosen = chosen.to(torch.int64)
    chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1))
    # Rank 1 is the most likely token; ties share the better rank (as vLLM).
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    max_top = min(max(num_top, default=0), logprobs.shape[1])
    all_ids: list[list[int]] = [[] for _ in num_top]
    all_values: list[list[float]] = [[] for _ in num_top]
    if max_top > 0:
        values, indices = logprobs.topk(max_top, dim=-1)
        all_values, all_ids = values.tolist(), indices.tolist()
    return _entries(chosen.tolist(), chosen_logprobs.squeeze(1).tolist(), ranks.tolist(), all_ids, all_values,
                    num_top)


def _entries(chosen: list[int], chosen_logprobs: list[float], ranks: list[int], top_ids: list[list[int]],
             top_logprobs: list[list[float]], num_top: Sequence[int]) -> list[TokenLogprobs]:
    return [TokenLogprobs(token_id=token, logprob=value, rank=rank, top_token_ids=ids[:k], top_logprobs=vals[:k])
            for token, value, rank, ids, vals, k in zip(chosen, chosen_logprobs, ranks, top_ids, top_logprobs,
                                                        num_top)]


@dataclass(slots=True)
class PromptLogprobsRequest:
    """Prompt positions one request scores in this step: flattened batch
    tokens [flat_start, flat_start + len(targets)) predict `targets`, the
    prompt tokens from index `first_token_index` on."""

    request_id: str
    flat_start: int
    targets: list[int]
    first_token_index: int
    num_top: int


def plan_prompt_logprobs(scheduled: Sequence[tuple[Any, int]], query_starts: Sequence[int]
                         ) -> list[PromptLogprobsRequest]:
    """Which batch positions score prompt tokens. `scheduled[i]` is (request
    state, chunk length) of the sequence starting at flat index
    `query_starts[i]`. The logits at position p score prompt token p + 1; the
    last prompt position is the sampling position and scores no prompt token."""
    planned = []
    for (state, num_tokens), flat_start in zip(scheduled, query_starts):
        wanted = state.sampling_params.prompt_logprobs
        if wanted is None:
            continue
        start = state.num_computed_tokens
        end = min(start + num_tokens, state.num_prompt_tokens - 1)
        if end <= start:
            continue
        planned.append(PromptLogprobsRequest(
            request_id=state.request_id, flat_start=flat_start, targets=state.token_ids[start + 1:end + 1],
            first_token_index=start + 1, num_top=wanted))
    return planned


def compute_prompt_logprobs(lm_head: LmHead, hidden: torch.Tensor,
                            planned: Sequence[PromptLogprobsRequest]) -> dict[str, PromptLogprobs]:
    """Run `lm_head` at the planned positions of `hidden` [T, hidden_size]."""
    results = {}
    for request in planned:
        positions: list[TokenLogprobs] = []
        for offset in range(0, len(request.targets), PROMPT_LOGITS_CHUNK):
            targets = request.targets[offset:offset + PROMPT_LOGITS_CHUNK]
            start = request.flat_start + offset
            logits = lm_head.logits(hidden[start:start + len(targets)])
            chosen = torch.tensor(targets, dtype=torch.int64, device=logits.device)
            positions += token_logprobs(logits, chosen, [request.num_top] * len(targets))
        results[request.request_id] = PromptLogprobs(first_token_index=request.first_token_index,
                                                     positions=positions)
    return results
