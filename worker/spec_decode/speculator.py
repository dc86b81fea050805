"""The worker's side of speculative decoding: keep a draft model in step with the
target, and propose drafts for the requests that sampled when the plan asks."""
from __future__ import annotations

from common.speculative_config import SpeculativeConfig
from worker.input_batch import StepBatch
from worker.spec_decode.draft_model_proposer import DraftModelProposer
from worker.spec_decode.ngram_proposer import NgramProposer


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft_model: DraftModelProposer | None = None):
        self.config = config
        self.ngram = NgramProposer(config) if config.method == "ngram" else None
        self.draft_model = draft_model

    def follow(self, batch: StepBatch) -> None:
        """After the target's forward of `batch`: the draft model's KV of the same tokens."""
        if self.draft_model is not None:
            self.draft_model.follow(batch.input_ids, batch.positions, batch.attn_metadata)

    def propose(self, batch: StepBatch) -> dict[str, list[int]]:
        """Drafts for the batch's sampling requests, after `batch.commit` (requests following
        a grammar get none: see scheduler.speculation)."""
        states = [s for s in batch.sampling_states if s.sampling_params.structured_outputs is None]
        if not states:
            return {}
        limits = [self.config.num_speculative_tokens] * len(states)
        if self.ngram is not None:
            drafts = self.ngram.propose([s.token_ids for s in states], limits)
        else:
            drafts = self.draft_model.propose([s.token_ids for s in states], [s.block_ids for s in states], limits)
        return {s.request_id: d for s, d in zip(states, drafts) if d}
