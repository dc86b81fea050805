"""Shared worker-test helpers: paged-batch metadata built by hand and tiny random HF models."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tiny_models import build_tiny_hf_model
from worker.attention.metadata import AttentionMetadata


def build_attention_metadata(context_lens: Sequence[int], query_lens: Sequence[int],
                             block_tables: Sequence[Sequence[int]], block_size: int,
                             num_decodes: int) -> AttentionMetadata:
    """Metadata for sequences that already hold `context_lens` tokens and add `query_lens`.
    The first `num_decodes` sequences must have query length 1."""
    assert all(q == 1 for q in query_lens[:num_decodes])
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    slots: list[int] = []
    for ctx, seq_len, table in zip(context_lens, seq_lens, block_tables):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, seq_len)]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    width = max(len(t) for t in block_tables) + 1  # a column of 0 padding, as the runner may send
    tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
    for row, table in enumerate(block_tables):
        tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
    return AttentionMetadata(
        num_decodes=num_decodes,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )


def shuffled_block_tables(seq_lens: Sequence[int], block_size: int, num_blocks: int,
                          generator: torch.Generator) -> list[list[int]]:
    """Enough blocks for each sequence, drawn without reuse from a shuffled pool of
    ids in [1, num_blocks) so tables are non-contiguous and out of order."""
    pool = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = []
    for seq_len in seq_lens:
        count = -(-seq_len // block_size)
        assert count <= len(pool), "num_blocks too small for these sequences"
        tables.append([pool.pop() for _ in range(count)])
    return tables


@pytest.fixture
def make_metadata() -> Callable[..., AttentionMetadata]:
    return build_attention_metadata


@pytest.fixture
def make_block_tables() -> Callable[..., list[list[int]]]:
    return shuffled_block_tables


@pytest.fixture
def tiny_hf_model(tmp_path: Path) -> Callable[..., tuple[Any, Path]]:
    """Factory: tiny_hf_model(architecture, **config_overrides) -> (hf_model, model_dir)."""
    def make(architecture: str, **overrides: Any) -> tuple[Any, Path]:
        directory = tmp_path / f"{architecture}-{len(list(tmp_path.iterdir()))}"
        return build_tiny_hf_model(architecture, directory, **overrides), directory
    return make
