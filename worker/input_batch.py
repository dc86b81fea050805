"""The worker's per-request state and the flattened batch it builds each step.

The scheduler sends a request's tokens and blocks once (NewRequestData) and
afterwards only diffs; the worker appends the tokens it samples itself, so a
decode step needs nothing from the scheduler but the token count.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from common.lora_request import LoRARequest
from common.pooling_params import PoolingParams
from common.protocol import ImageInput, StepPlan
from common.sampling_params import SamplingParams
from worker.attention.metadata import AttentionMetadata
from worker.image_embeddings import ImageChunk, plan_image_chunks
from worker.models.mrope import prompt_mrope_positions, step_mrope_positions
from worker.logprobs import PromptLogprobsRequest, plan_prompt_logprobs
from worker.sampler import SamplingMetadata
from worker.structured_output import GrammarCompiler, GrammarMatcher

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    token_ids: list[int]  # prompt, then every token generated so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is in the cache
    grammar: GrammarMatcher | None = None  # structured output: where the outputs stand in the grammar
    pooling_params: PoolingParams | None = None  # a pooling request: pooled (worker.pooler), never sampled
    lora_request: LoRARequest | None = None  # its adapter (worker.lora_slots); None: the base model
    pooled_so_far: torch.Tensor | None = None  # MEAN: the float32 sum of its chunks; CLS: the first token's
    images: list[ImageInput] = field(default_factory=list)  # a vision-language prompt's images
    image_embeds: dict[int, torch.Tensor] = field(default_factory=dict)  # encoded images still being computed
    mrope_positions: np.ndarray | None = None  # M-RoPE models: the prompt's [3, P] positions (worker.models.mrope)
    mrope_delta: int = 0  # ... and what the positions past the prompt add to their index

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class StepBatch:
    """Everything one forward pass needs, in batch order (decodes first)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 (M-RoPE: [3, T] while image placeholders run; worker.models.mrope)
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: index in [T] of each sampling request's last token
    sampling_states: list[RequestState]  # the S requests that sample, in logits order
    sampling_metadata: SamplingMetadata
    scheduled: list[tuple[RequestState, int]]  # every request that runs, with its token count
    # Requests scoring prompt tokens this step (prompt_logprobs), with their batch positions.
    prompt_logprobs: list[PromptLogprobsRequest] = field(default_factory=list)
    # Speculative decoding: each sampling request's drafts to check (empty: none). A request with
    # k drafts has k + 1 rows in logits_indices and in the sampling metadata, one per position.
    drafts: list[list[int]] | None = None
    # Pooling requests that run this step: (state, index in [T] of its chunk's first token, chunk length).
    pooling: list[tuple[RequestState, int, int]] = field(default_factory=list)
    image_chunks: list[ImageChunk] = field(default_factory=list)  # image rows to merge (worker.image_embeddings)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def sampling_request_ids(self) -> list[str]:
        return [state.request_id for state in self.sampling_states]

    def commit(self, sampled_token_ids: list[int], accepted: list[list[int]] | None = None) -> None:
        """Record a finished step in the request states: every scheduled chunk
        is now in the KV cache and each sampled token joins its request, so
        the next step's decode input is known without a resend. `accepted[i]`:
        the drafts sampling request i accepted, which join before its token (the
        rejected ones' KV does not count)."""
        if len(sampled_token_ids) != len(self.sampling_states):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for {len(self.sampling_states)} requests")
        for state, num_tokens in self.scheduled:
            state.num_computed_tokens += num_tokens
        for i, (state, token_id) in enumerate(zip(self.sampling_states, sampled_token_ids)):
            if self.drafts is not None and self.drafts[i]:
                taken = accepted[i] if accepted is not None else []
                state.num_computed_tokens -= len(self.drafts[i]) - len(taken)
                new_tokens = [*taken, token_id]
            else:
                new_tokens = [token_id]
            for token in new_tokens:
                state.token_ids.append(token)
                if state.grammar is not None:
                    state.grammar.accept(token)

    @property
    def rows_per_request(self) -> list[int]:
        """Sampling rows of each sampling request: 1, or 1 + its drafts."""
        if self.drafts is None:
            return [1] * len(self.sampling_states)
        return [1 + len(d) for d in self.drafts]


class InputBatch:
    """Holds the state of every request the scheduler has handed this worker
    and turns each StepPlan into a StepBatch."""

    def __init__(self, block_size: int, device: torch.device | str = "cpu", eos_token_ids: Sequence[int] = (),
                 grammar_compiler: GrammarCompiler | None = None, mrope_merge_size: int = 0):
        """`mrope_merge_size`: the vision merge size of an M-RoPE model (Qwen2-VL), else 0."""
        self.block_size = block_size
        self.mrope_merge_size = mrope_merge_size
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)  # min_tokens keeps them from being sampled
        self.grammar_compiler = grammar_compiler  # None: structured outputs are refused
        self.requests: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def apply_plan(self, plan: StepPlan) -> None:
        """Drop finished ids, then add (or replace) new requests, then apply diffs.

        Dropping first matters: a preempted request is listed as finished and
        may come back as a new request, possibly in the same plan.
        """
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            self.requests[new.request_id] = RequestState(
                request_id=new.request_id, token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens, sampling_params=new.sampling_params,
                block_ids=list(new.block_ids), num_computed_tokens=new.num_computed_tokens,
                grammar=self._grammar(new.request_id, new.sampling_params, new.token_ids[new.num_prompt_tokens:]),
                pooling_params=new.pooling_params, images=list(new.images), lora_request=new.lora_request)
            if self.mrope_merge_size and new.images:
                state = self.requests[new.request_id]
                state.mrope_positions, state.mrope_delta = prompt_mrope_positions(
                    new.num_prompt_tokens, state.images, self.mrope_merge_size)
        for diff in plan.cached_requests:
            state = self.requests.get(diff.request_id)
            if state is None:
                raise KeyError(f"step {plan.step_id}: diff for unknown request {diff.request_id!r}")
            if diff.num_blocks_kept >= 0:
                del state.block_ids[diff.num_blocks_kept:]
            state.block_ids.extend(diff.new_block_ids)
            state.num_computed_tokens = diff.num_computed_tokens

    def build(self, num_scheduled_tokens: dict[str, int],
              draft_token_ids: dict[str, list[int]] | None = None) -> StepBatch | None:
        """The flattened batch for the scheduled requests, or None if there are none.
        `draft_token_ids`: drafts to check after a request's last known token (they
        count in its scheduled tokens)."""
        scheduled = [(self._state(request_id), n) for request_id, n in num_scheduled_tokens.items() if n > 0]
        if not scheduled:
            return None
        drafts_of = draft_token_ids or {}
        # Decodes (one query token) first, keeping plan order within each group.
        scheduled = [s for s in scheduled if s[1] == 1] + [s for s in scheduled if s[1] != 1]
        for state, n in scheduled:
            num_drafts = len(drafts_of.get(state.request_id, ()))
            if num_drafts and (state.num_computed_tokens + 1 != state.num_tokens or n != 1 + num_drafts):
                raise ValueError(f"request {state.request_id!r}: {num_drafts} drafts need one decode token "
                                 f"before them, but {n} tokens are scheduled after {state.num_computed_tokens} "
                                 f"of {state.num_tokens}")
            if state.num_computed_tokens + n > state.num_tokens + num_drafts:
                raise ValueError(f"request {state.request_id!r}: {n} tokens scheduled after "
                                 f"{state.num_computed_tokens} computed, but only {state.num_tokens} known")

        num_seqs = len(scheduled)
        query_lens = np.fromiter((n for _, n in scheduled), dtype=np.int64, count=num_seqs)
        context_lens = np.fromiter((s.num_computed_tokens for s, _ in scheduled), dtype=np.int64, count=num_seqs)
        seq_lens = context_lens + query_lens
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        input_ids = np.empty(num_tokens, dtype=np.int64)
        image_chunks: list[ImageChunk] = []  # image rows to merge (worker.image_embeddings)
        mrope_rows: list[tuple[RequestState, int, int, int]] = []  # M-RoPE requests' rows (worker.models.mrope)
        for (state, n), start, context in zip(scheduled, query_start_loc.tolist(), context_lens.tolist()):
            if state.images:
                image_chunks += plan_image_chunks(state, start, context, n)
                if state.mrope_positions is not None:
                    mrope_rows.append((state, start, context, n))
            drafts = drafts_of.get(state.request_id)
            if drafts:
                input_ids[start] = state.token_ids[context]
                input_ids[start + 1:start + n] = drafts
            else:
                input_ids[start:start + n] = state.token_ids[context:context + n]

        # Token-level arrays, vectorized: which sequence each token belongs to
        # and how far into its query it sits.
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start_loc[:-1] - context_lens, query_lens)
        block_tables = self._block_tables(scheduled, seq_lens)
        block_ids = block_tables[seq_of_token, positions // self.block_size].astype(np.int64)
        slot_mapping = block_ids * self.block_size + positions % self.block_size
        rope_positions = step_mrope_positions(positions, mrope_rows, bool(image_chunks)) if mrope_rows else positions

        samples = np.fromiter((s.num_computed_tokens + n >= s.num_tokens and s.pooling_params is None
                               for s, n in scheduled), dtype=bool, count=num_seqs)
        sampling_states = [state for (state, _), sample in zip(scheduled, samples.tolist()) if sample]
        if drafts_of:
            drafts = [drafts_of.get(state.request_id, []) for state in sampling_states]
            ends = query_start_loc[1:][samples]
            logits_indices = np.concatenate([np.arange(end - 1 - len(d), end) for end, d in zip(ends, drafts)])
            sampling_params, rows = self._draft_rows(sampling_states, drafts)
        else:
            drafts = None
            logits_indices = query_start_loc[1:][samples] - 1
            rows = [(s, s.token_ids) for s in sampling_states]
            sampling_params = [s.sampling_params for s in sampling_states]

        return StepBatch(
            input_ids=self._to_device(input_ids),
            positions=self._to_device(rope_positions),
            attn_metadata=AttentionMetadata(
                num_decodes=int(np.count_nonzero(query_lens == 1)),
                slot_mapping=self._to_device(slot_mapping),
                query_start_loc=self._to_device(query_start_loc.astype(np.int32)),
                seq_lens=self._to_device(seq_lens.astype(np.int32)),
                block_tables=self._to_device(block_tables),
                max_query_len=int(query_lens.max()),
                max_seq_len=int(seq_lens.max()),
                query_start_loc_cpu=query_start_loc.tolist(),
                seq_lens_cpu=seq_lens.tolist(),
            ),
            logits_indices=self._to_device(logits_indices),
            sampling_states=sampling_states,
            sampling_metadata=SamplingMetadata.build(
                sampling_params,
                [len(tokens) - s.num_prompt_tokens for s, tokens in rows], self.device,
                token_ids=[tokens for _, tokens in rows],
                num_prompt_tokens=[s.num_prompt_tokens for s, _ in rows],
                eos_token_ids=self.eos_token_ids,
                grammars=[s.grammar for s, _ in rows] if self._any_grammar(sampling_states) else None),
            scheduled=scheduled,
            prompt_logprobs=plan_prompt_logprobs(scheduled, query_start_loc[:-1].tolist()),
            drafts=drafts,
            pooling=[(state, start, n) for (state, n), start in zip(scheduled, query_start_loc.tolist())
                     if state.pooling_params is not None],
            image_chunks=image_chunks,
        )

    @staticmethod
    def _draft_rows(states: list[RequestState], drafts: list[list[int]]
                    ) -> tuple[list[SamplingParams], list[tuple[RequestState, list[int]]]]:
        """One sampling row per checked position: row i of a request with drafts d
        samples as the request would after accepting d[:i] (its penalties, min_tokens,
        bad words and seed's noise see those tokens; see worker.spec_decode)."""
        params: list[SamplingParams] = []
        rows: list[tuple[RequestState, list[int]]] = []
        for state, d in zip(states, drafts):
            if d and state.grammar is not None:
                raise ValueError(f"request {state.request_id!r} follows a grammar: its drafts cannot be checked")
            for i in range(len(d) + 1):
                params.append(state.sampling_params)
                rows.append((state, state.token_ids + d[:i] if i else state.token_ids))
        return params, rows

    def _grammar(self, request_id: str, params: SamplingParams, output_ids: Sequence[int]) -> GrammarMatcher | None:
        spec = params.structured_outputs
        if spec is None:
            return None
        try:
            if self.grammar_compiler is None:
                raise RuntimeError("this worker has no grammar compiler")
            return self.grammar_compiler.matcher(spec, request_id, output_ids)
        except Exception:  # the frontend checked the spec: failing here must not take the worker down
            logger.exception("request %s: cannot compile its structured output (%s); generating without it",
                             request_id, spec.describe())
            return None

    def _state(self, request_id: str) -> RequestState:
        state = self.requests.get(request_id)
        if state is None:
            raise KeyError(f"scheduled request {request_id!r} is unknown to the worker")
        return state

    @staticmethod
    def _any_grammar(states: list[RequestState]) -> bool:
        return any(state.grammar is not None for state in states)

    def _block_tables(self, scheduled: list[tuple[RequestState, int]], seq_lens: np.ndarray) -> np.ndarray:
        """[B, max_blocks] int32 padded with block 0, holding only the blocks
        each sequence uses this step (the scheduler may have allocated more)."""
        blocks_needed = -(-seq_lens // self.block_size)
        table = np.zeros((len(scheduled), int(blocks_needed.max())), dtype=np.int32)
        for row, ((state, _), needed) in enumerate(zip(scheduled, blocks_needed.tolist())):
            if len(state.block_ids) < needed:
                raise ValueError(f"request {state.request_id!r} needs {needed} blocks for "
                                 f"{int(seq_lens[row])} tokens but holds {len(state.block_ids)}")
            table[row, :needed] = state.block_ids[:needed]
        return table

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)
