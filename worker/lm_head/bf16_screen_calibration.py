"""The start-up calibration batch of the bf16 lm_head's int8 screen
(`worker.lm_head.bf16_int8_screen`): a few sequences of seeded random token ids,
prefilled through the real model step into KV blocks 1.., whose final hidden
states show which channels carry the outliers. Random ids suffice: the outlier
channels are the model's, not the text's (the channels picked from W2's random
prompts and from W1's screen equally fast). Only speed depends on the outcome.

Nothing is allocated for it: before the first request every block but the null
block 0 is free, and the scheduler overwrites a block before it reads one.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from worker.attention.metadata import AttentionMetadata
from worker.lm_head.interface import LmHead

logger = logging.getLogger(__name__)

CALIBRATION_SEQUENCES = 4
CALIBRATION_SEED = 0


def calibration_batch(vocab_size: int, block_size: int, num_blocks: int, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata] | None:
    """(input_ids, positions, meta) of up to CALIBRATION_SEQUENCES one-block prompts in
    blocks 1..; None without a free block."""
    sequences = min(CALIBRATION_SEQUENCES, num_blocks - 1)
    if sequences < 1:
        return None
    tokens = sequences * block_size
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    input_ids = torch.randint(0, vocab_size, (tokens,), generator=generator).to(device)
    offsets = torch.arange(block_size, dtype=torch.int64)
    blocks = torch.arange(1, sequences + 1, dtype=torch.int64)
    meta = AttentionMetadata(
        num_decodes=0,
        slot_mapping=(blocks[:, None] * block_size + offsets).flatten().to(device),
        query_start_loc=torch.arange(0, tokens + 1, block_size, dtype=torch.int32, device=device),
        seq_lens=torch.full((sequences,), block_size, dtype=torch.int32, device=device),
        block_tables=blocks.to(torch.int32)[:, None].to(device),
        max_query_len=block_size, max_seq_len=block_size,
        query_start_loc_cpu=list(range(0, tokens + 1, block_size)), seq_lens_cpu=[block_size] * sequences)
    return input_ids, offsets.repeat(sequences).to(device), meta


def calibrate_lm_head(lm_head: LmHead, forward: Callable[..., torch.Tensor], block_size: int,
                      num_blocks: int, device: torch.device) -> bool:
    """Run the calibration batch through `forward` (input_ids, positions, meta -> final hidden
    states) and calibrate `lm_head` with them, if it wants it; returns whether it was calibrated."""
    if not lm_head.wants_calibration():
        return False
    batch = calibration_batch(lm_head.vocab_size, block_size, num_blocks, device)
    if batch is None:
        return False
    started = time.perf_counter()
    with torch.inference_mode():
        hidden = forward(*batch)
    calibrated = lm_head.calibrate(hidden)
    if calibrated:
        logger.info("Greedy lm_head screen armed (int8, outlier channels calibrated on %d tokens) in %.1f s",
                    hidden.shape[0], time.perf_counter() - started)
    return calibrated
