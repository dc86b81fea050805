"""A draft model: a smaller model with the target's vocabulary, run in the same worker
with its own paged KV cache, proposing greedily.

Its cache has the target's block ids and block size, so the scheduler's block tables
serve both. It runs on every batch the target runs (same tokens, positions and
metadata: its KV of every computed token stays valid, prefix-cache hits included),
then, for the requests that sampled, k one-token steps from their newest token:
each step's argmax is the next draft. Those steps write KV past the sequence, into
the lookahead slots the scheduler allocates (SpeculativeConfig.lookahead_slots);
the next batch writes those positions again with the tokens that stood.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from common.config import EngineConfig
from common.errors import ConfigError
from worker.attention.metadata import AttentionMetadata
from worker.compiled_forward import ModelForward
from worker.kv_cache import KVCacheSpec, allocate_kv_caches, kv_cache_spec
from worker.lm_head.final_softcap import with_final_softcap
from worker.lm_head.plain_logits import PlainLogitsLmHead
from worker.model_loader import load_model
from worker.models.packed_linear import pack_weight
from worker.quantization import prepare_linear_weights

logger = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 target_vocab_size: int):
        spec = config.speculative_config
        self.k = spec.num_speculative_tokens
        self.device = device
        self.block_size = config.block_size
        draft_config = config.replace(model=spec.model, speculative_config=None, quantization=None,
                                      kv_cache_dtype="auto")
        self.model, self.hf_config, self.model_dir = load_model(draft_config, device, dtype)
        vocab = int(self.hf_config.vocab_size)
        if vocab != target_vocab_size:
            raise ConfigError(f"the draft model {spec.model} has a vocabulary of {vocab} tokens, the model "
                              f"{target_vocab_size}: a draft model must share the model's tokenizer")
        prepare_linear_weights(self.model, draft_config)
        weight = self.model.lm_head
        self.lm_head = with_final_softcap(PlainLogitsLmHead(weight, pack_weight(weight)),
                                          getattr(self.model, "final_logit_softcapping", None))
        self.kv_dtype = kv_dtype
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.forward: ModelForward | None = None

    def kv_spec(self) -> KVCacheSpec:
        return kv_cache_spec(self.hf_config, self.block_size, self.kv_dtype, num_layers=len(self.model.layers))

    def allocate(self, num_blocks: int, max_model_len: int, backend: Any) -> None:
        """The draft's cache, with the target's block count (call once the worker knows it)."""
        self.kv_caches = allocate_kv_caches(self.hf_config, num_blocks, self.block_size, self.kv_dtype, self.device,
                                            max_model_len=max_model_len, spec=self.kv_spec())
        self.forward = ModelForward(self.model, self.kv_caches, backend, max_model_len=max_model_len + self.k,
                                    compile=False)

    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Run the target's batch: the draft's KV of those tokens."""
        self.forward(input_ids, positions, meta)

    def propose(self, token_ids: Sequence[Sequence[int]], block_ids: Sequence[Sequence[int]],
                limits: Sequence[int]) -> list[list[int]]:
        """Up to limits[i] drafts after sequence i (whose KV the draft holds but for its last
        token), each within the blocks the sequence holds."""
        bs = self.block_size
        counts = [max(0, min(limit, self.k, len(blocks) * bs - len(tokens) + 1))
                  for tokens, blocks, limit in zip(token_ids, block_ids, limits)]
        drafts: list[list[int]] = [[] for _ in token_ids]
        last = [int(tokens[-1]) for tokens in token_ids]
        for step in range(max(counts, default=0)):
            rows = [i for i, count in enumerate(counts) if step < count]
            positions = [len(token_ids[i]) - 1 + step for i in rows]
            meta = decode_metadata([block_ids[i] for i in rows], positions, bs, self.device)
            hidden = self.forward(torch.tensor([last[i] for i in rows], dtype=torch.int64, device=self.device),
                                  torch.tensor(positions, dtype=torch.int64, device=self.device), meta)
            picked = self.lm_head.logits(hidden, upcast=False).max(dim=-1).indices.tolist()
            for i, token in zip(rows, picked):
                drafts[i].append(token)
                last[i] = token
        return drafts


def decode_metadata(block_ids: Sequence[Sequence[int]], positions: Sequence[int], block_size: int,
                    device: torch.device) -> AttentionMetadata:
    """Attention inputs for one query token per sequence, at `positions`."""
    num_seqs = len(positions)
    pos = np.asarray(positions, dtype=np.int64)
    seq_lens = pos + 1
    needed = -(-seq_lens // block_size)
    table = np.zeros((num_seqs, int(needed.max())), dtype=np.int32)
    for row, (blocks, count) in enumerate(zip(block_ids, needed.tolist())):
        table[row, :count] = blocks[:count]
    slots = table[np.arange(num_seqs), pos // block_size].astype(np.int64) * block_size + pos % block_size

    def put(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    return AttentionMetadata(
        num_decodes=num_seqs, slot_mapping=put(slots),
        query_start_loc=put(np.arange(num_seqs + 1, dtype=np.int32)), seq_lens=put(seq_lens.astype(np.int32)),
        block_tables=put(table), max_query_len=1, max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=list(range(num_seqs + 1)), seq_lens_cpu=seq_lens.tolist())
