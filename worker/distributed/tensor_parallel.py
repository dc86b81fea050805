"""The collectives of a tensor-parallel forward pass.

`tp_all_reduce` sums the partial outputs of the row-parallel projections (o_proj,
down_proj) and the vocabulary-parallel embedding over the ranks of this rank's
stage: through shared memory when they share a host, else torch.distributed. It is
an opaque custom op, as the attention is: the compiled layer graph calls it like
any op and inductor never looks inside.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from worker.distributed import parallel_state


@torch.library.custom_op("pagedserve::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    shm = parallel_state.tp_shm()
    if shm is not None and shm.fits(x):  # ranks on one host (worker.distributed.shm_all_reduce)
        return shm(x.contiguous())
    out = x.clone()
    dist.all_reduce(out, group=parallel_state.tp_group())
    return out


@tp_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def tp_all_gather(x: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor rank's `x` (same shape on each), in rank order."""
    parts = [torch.empty_like(x) for _ in range(parallel_state.layout().tp_size)]
    dist.all_gather(parts, x.contiguous(), group=parallel_state.tp_group())
    return parts


def vocab_parallel_embedding(input_ids: torch.Tensor, shard: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Embeddings of `input_ids` from this rank's rows [vocab_start, vocab_start + len(shard)) of the
    table; the other ranks add the rows they hold (each id lives on exactly one rank)."""
    local = input_ids - vocab_start
    outside = (local < 0) | (local >= shard.shape[0])
    hidden = F.embedding(local.masked_fill(outside, 0), shard)
    hidden = hidden.masked_fill(outside.unsqueeze(-1), 0)
    return tp_all_reduce(hidden)
