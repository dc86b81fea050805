"""One engine step on the device: forward, logits for sampling rows only, sample."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from common.protocol import PromptLogprobs, StepResult, TokenLogprobs
from worker.compiled_forward import ModelForward
from worker.cuda_graphs import GraphedForward
from worker.distributed import parallel_state
from worker.distributed.stage_results import StageResults
from worker.image_embeddings import merged_input_embeddings
from worker.input_batch import StepBatch
from worker.lm_head import LmHead
from worker.lm_head.bf16_screen_calibration import calibrate_lm_head
from worker.logprobs import compute_prompt_logprobs
from worker.pooler import pool_step
from worker.sampler import Sampler
from worker.spec_decode.speculator import Speculator
from worker.spec_decode.verification import verify


@dataclass(slots=True)
class RunnerOutput:
    request_ids: list[str]  # the requests that sampled, in logits order
    sampled_token_ids: list[int]
    sampled_logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # rows that asked
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)  # speculative decoding (StepResult)
    draft_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    proposals: dict[str, list[int]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # pooling requests whose prompt ended


def runner_output(result: StepResult) -> RunnerOutput:
    return RunnerOutput(list(result.request_ids), list(result.sampled_token_ids), dict(result.sampled_logprobs),
                        dict(result.prompt_logprobs))


class ModelRunner:
    def __init__(self, model: Any, lm_head: LmHead | None, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 backend: Any, block_size: int, device: torch.device | str = "cpu", seed: int = 0,
                 forward: ModelForward | None = None, speculator: Speculator | None = None):
        """`lm_head`: the strategy chosen for the model's lm_head (worker.lm_head.choose_lm_head);
        `forward`: how the model runs (compiled or eager, see ModelForward); eager by default.
        In a pipeline-parallel group, only the last stage has an lm_head (None elsewhere): it
        samples and hands the step's tokens to every other rank (`StageResults`)."""
        self.model = model
        self.lm_head = lm_head
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler(seed)
        self.forward = forward or ModelForward(model, kv_caches, backend, max_model_len=0, compile=False)
        self.stage_results = StageResults() if parallel_state.layout().pp_size > 1 else None
        self.speculator = speculator  # speculative decoding (one rank only: EngineConfig checks)

    def execute(self, batch: StepBatch, speculate: bool = False) -> RunnerOutput:
        """Run the batch; return the ids of the requests that sampled, their
        tokens, and any logprobs the requests asked for. With drafts in the batch,
        also the drafts each request accepted; with `speculate`, drafts to check next step.

        Side effects on the request states (so the next step needs no resend
        from the scheduler): every scheduled request's num_computed_tokens
        advances by its chunk (less its rejected drafts), and each new token is appended.
        """
        with torch.inference_mode():
            if batch.image_chunks:  # placeholders of images this step: their embeddings, no decode graph
                forward = self.forward.forward if isinstance(self.forward, GraphedForward) else self.forward
                hidden = forward(batch.input_ids, batch.positions, batch.attn_metadata,
                                 inputs_embeds=merged_input_embeddings(self.model, batch.input_ids, batch.image_chunks))
            else:
                hidden = self.forward(batch.input_ids, batch.positions, batch.attn_metadata)
            pooled = pool_step(batch.pooling, hidden) if batch.pooling else {}
            if self.speculator is not None:
                self.speculator.follow(batch)
            if self.lm_head is None and self.stage_results is not None:  # an earlier stage: the last samples
                output = runner_output(self.stage_results.receive())
                batch.commit(output.sampled_token_ids)
                return output
            prompt_logprobs = (compute_prompt_logprobs(self.lm_head, hidden, batch.prompt_logprobs)
                               if batch.prompt_logprobs else {})
            row_logprobs: list[TokenLogprobs | None] | None = None
            if batch.logits_indices.numel() == 0:
                sampled: list[int] = []
            else:
                # The lm_head is the biggest matmul; run it only where a token is sampled.
                if batch.logits_indices.numel() != hidden.shape[0]:  # else every token samples (all decodes)
                    hidden = hidden.index_select(0, batch.logits_indices)
                meta = batch.sampling_metadata
                greedy = self.lm_head.greedy(hidden) if meta.plain_argmax else None
                if greedy is not None:  # every row a plain argmax: no logits needed
                    sampled = greedy.tolist()
                else:
                    # Only the adjustments (penalties, biases, masks) need float32 logits to add to.
                    logits = self.lm_head.logits(hidden, upcast=meta.adjustments is not None)
                    sample_output = self.sampler.sample(logits, meta, self.lm_head, hidden)
                    sampled = sample_output.token_ids.tolist()
                    row_logprobs = sample_output.logprobs
            output = self._outputs(batch, sampled, row_logprobs, prompt_logprobs)
            output.pooled = pooled
        if self.stage_results is not None:  # every rank commits the same tokens: the result rank's
            output = runner_output(self.stage_results.share(StepResult(
                step_id=0, request_ids=output.request_ids, sampled_token_ids=output.sampled_token_ids,
                sampled_logprobs=output.sampled_logprobs, prompt_logprobs=output.prompt_logprobs)))
        states = batch.sampling_states
        batch.commit(output.sampled_token_ids, [output.accepted_draft_ids.get(s.request_id, []) for s in states]
                     if batch.drafts is not None else None)
        if speculate and self.speculator is not None and states:
            with torch.inference_mode():
                output.proposals = self.speculator.propose(batch)
        return output

    @staticmethod
    def _outputs(batch: StepBatch, sampled: list[int], row_logprobs: list[TokenLogprobs | None] | None,
                 prompt_logprobs: dict[str, PromptLogprobs]) -> RunnerOutput:
        """Per sampling request: its token, and with drafts, those it accepted (verification)."""
        ids = batch.sampling_request_ids
        if batch.drafts is None:
            logprobs = ({rid: entry for rid, entry in zip(ids, row_logprobs) if entry is not None}
                        if row_logprobs is not None else {})
            return RunnerOutput(ids, sampled, logprobs, prompt_logprobs)
        checked = verify(batch.drafts, sampled, row_logprobs)
        output = RunnerOutput(ids, checked.tokens, {}, prompt_logprobs)
        for i, rid in enumerate(ids):
            if batch.drafts[i]:
                output.accepted_draft_ids[rid] = checked.accepted[i]
            if row_logprobs is not None and checked.logprobs[i] is not None:
                output.sampled_logprobs[rid] = checked.logprobs[i]
                if checked.draft_logprobs[i]:
                    output.draft_logprobs[rid] = checked.draft_logprobs[i]
        return output

    def warm_up(self) -> None:
        """Compile what the lm_head's first steps would otherwise compile (the near-tie scan, when
        near ties are re-scored), and calibrate its greedy screen (bf16_screen_calibration)."""
        if self.lm_head is None:
            return
        self.lm_head.warm_up(self.device)
        if self.kv_caches and parallel_state.layout().world_size == 1:  # (a forward alone: not in a group)
            calibrate_lm_head(self.lm_head, self.forward, self.block_size, self.kv_caches[0][0].shape[0],
                              self.device)
