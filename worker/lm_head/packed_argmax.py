"""The float32 packed lm_head with a fused greedy argmax.

Greedy rows take `pagedserve::packed_linear_argmax` (worker/csrc/lm_head_argmax.cpp):
each row's argmax of hidden @ W.T (the first on ties, the first NaN if any)
from the packed weight, without writing the [N, vocab] logits, which for a
large decode step are the biggest tensor of the step. Chosen for float32
models on AVX-512 CPUs without AVX512-VNNI (with it: `int16_screen`).
"""
from __future__ import annotations

import torch

from worker.lm_head.plain_logits import PlainLogitsLmHead


class PackedArgmaxLmHead(PlainLogitsLmHead):
    name = "packed float32 argmax"

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor):
        """`weight` float32 [vocab, hidden] and its packed copy (`pack_weight`)."""
        if weight.dtype != torch.float32 or packed is None or packed.dtype != torch.float32:
            raise ValueError("the packed argmax takes a float32 lm_head and its float32 packing")
        super().__init__(weight, packed)

    @torch.no_grad()
    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.pagedserve.packed_linear_argmax(hidden, self.packed, self.vocab_size)
