"""Pipeline parallelism: which layers a stage holds, and hidden states passed between stages.

Layers are split in consecutive, near-equal runs (earlier stages take the
remainder: the last stage also runs the lm_head). Each tensor rank sends its
stage's output to the same tensor rank of the next stage (after the
row-parallel all-reduce every tensor rank holds the whole hidden state).
Every rank builds the same batch from the same plan, so the receiver knows the
shape without being told.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from common.errors import ConfigError
from worker.distributed import parallel_state


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[first, end) of the layers pipeline stage `pp_rank` of `pp_size` holds."""
    if pp_size > num_layers:
        raise ConfigError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    first = pp_rank * base + min(pp_rank, extra)
    return first, first + base + (1 if pp_rank < extra else 0)


def send_hidden(hidden: torch.Tensor) -> None:
    state = parallel_state.layout()
    dist.send(hidden.contiguous(), dst=state.stage_rank(state.pp_rank + 1))


def receive_hidden(num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    state = parallel_state.layout()
    hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    dist.recv(hidden, src=state.stage_rank(state.pp_rank - 1))
    return hidden
