"""Pipeline parallelism: hidden states passed from stage to stage (common.parallel_layout
says which layers each stage holds). Each tensor rank sends its
stage's output to the same tensor rank of the next stage (after the
row-parallel all-reduce every tensor rank holds the whole hidden state).
Every rank builds the same batch from the same plan, so the receiver knows the
shape without being told.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from worker.distributed import parallel_state


def send_hidden(hidden: torch.Tensor) -> None:
    state = parallel_state.layout()
    dist.send(hidden.contiguous(), dst=state.stage_rank(state.pp_rank + 1))


def receive_hidden(num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    state = parallel_state.layout()
    hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    dist.recv(hidden, src=state.stage_rank(state.pp_rank - 1))
    return hidden
