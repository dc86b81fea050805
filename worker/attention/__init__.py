"""Paged attention backends (see docs/architecture.md for the contract) and their factory."""
from __future__ import annotations

from typing import Any, Protocol

import torch

from worker.attention.metadata import AttentionMetadata

BACKEND_NAMES = ("torch", "triton")


class AttentionBackend(Protocol):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                *, scale: float, sliding_window: int | None) -> torch.Tensor:
        """Write key/value at meta.slot_mapping, then return attention output [T, H, D].
        Backends with `supports_softcap` also take `softcap` (attention logit soft-capping);
        the step context refuses a soft-capped model on any other backend."""
        ...


def get_attention_backend(name: str, **backend_kwargs: Any) -> AttentionBackend:
    """Build the backend called `name` ("torch" or "triton"); kwargs go to its constructor.

    The triton backend is imported only when asked for, so CPU-only installs never import triton.
    """
    if name == "torch":
        from worker.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend(**backend_kwargs)
    if name == "triton":
        from worker.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(**backend_kwargs)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
