"""One engine step on the device: forward, logits for sampling rows only, sample."""
from __future__ import annotations

from typing import Any

import torch

from worker.input_batch import StepBatch
from worker.sampler import Sampler


class ModelRunner:
    def __init__(self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: Any,
                 block_size: int, device: torch.device | str = "cpu", seed: int = 0):
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler(seed, self.device)

    def execute(self, batch: StepBatch) -> tuple[list[str], list[int]]:
        """Run the batch; return the ids of the requests that sampled and their tokens.

        Side effects on the request states (so the next step needs no resend
        from the scheduler): every scheduled request's num_computed_tokens
        advances by its chunk, and each sampled token is appended.
        """
        with torch.inference_mode():
            hidden = self.model.forward(batch.input_ids, batch.positions, self.kv_caches,
                                        batch.attn_metadata, self.backend)
            if batch.logits_indices.numel() == 0:
                sampled: list[int] = []
            else:
                # The lm_head is the biggest matmul; run it only where a token is sampled.
                if batch.logits_indices.numel() != hidden.shape[0]:  # else every token samples (all decodes)
                    hidden = hidden.index_select(0, batch.logits_indices)
                logits = self.model.compute_logits(hidden)
                sampled = self.sampler(logits, batch.sampling_metadata).tolist()
        batch.commit(sampled)
        return batch.sampling_request_ids, sampled
