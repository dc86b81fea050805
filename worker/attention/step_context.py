"""The attention call of a model layer, with the step's state held outside the model.

A model layer asks for attention with tensors only (query, key, value, its
layer index); the backend, the step's AttentionMetadata and the KV caches
come from the context the runner opens around the forward pass. That keeps
the model's forward a pure tensor function that `torch.compile` can capture
in one graph: under compilation the call is the opaque custom op
`pagedserve::paged_attention` (the compiler never looks inside, and the
cache writes it makes are invisible to it, which is safe because the caches
are not graph values); in eager mode it is a direct call.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from worker.attention.kv_rotation import rotate
from worker.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class StepContext:
    backend: Any
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    kv_scales: list[tuple[float, float]] | None = None  # per layer (k_scale, v_scale) of an 8-bit cache
    kv_rotation: dict[int, torch.Tensor] | None = None  # head_dim -> rotation of q and k (kv_rotation.py)


_current: StepContext | None = None


@contextlib.contextmanager
def step_context(backend: Any, meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 kv_scales: list[tuple[float, float]] | None = None,
                 kv_rotation: dict[int, torch.Tensor] | None = None) -> Iterator[StepContext]:
    global _current
    previous, _current = _current, StepContext(backend, meta, kv_caches, kv_scales, kv_rotation)
    try:
        yield _current
    finally:
        _current = previous


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
            sliding_window: int, softcap: float = 0.0) -> torch.Tensor:
    ctx = _current
    if ctx is None:
        raise RuntimeError("attention called outside a step context (use the model's forward)")
    k_cache, v_cache = ctx.kv_caches[layer]
    window = sliding_window if sliding_window > 0 else None
    # Only 8-bit caches have scales, only soft-capped models a softcap: other calls stay as they were.
    extra = {} if ctx.kv_scales is None else dict(zip(("k_scale", "v_scale"), ctx.kv_scales[layer]))
    if softcap > 0:
        if not getattr(ctx.backend, "supports_softcap", False):
            raise ValueError(f"attention backend {getattr(ctx.backend, 'name', type(ctx.backend).__name__)!r} "
                             "cannot apply attention logit soft-capping (attn_logit_softcapping); "
                             "use the torch or triton backend")
        extra["softcap"] = softcap
    if ctx.kv_rotation is not None:  # scores unchanged, keys cached rotated
        rotation = ctx.kv_rotation[query.shape[-1]]
        query, key = rotate(query, rotation), rotate(key, rotation)
    return ctx.backend.forward(query, key, value, k_cache, v_cache, ctx.meta, scale=scale, sliding_window=window,
                               **extra)


# Defined through torch.library.Library rather than the `custom_op` decorator: a call then costs
# about 2 µs instead of 12 (no autograd wrapper, no aliasing check), once per layer and step.
_library = torch.library.Library("pagedserve", "FRAGMENT")
_library.define("paged_attention(Tensor query, Tensor key, Tensor value, SymInt layer, float scale, "
                "SymInt sliding_window, float softcap=0.0) -> Tensor")


def _attend_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
               sliding_window: int, softcap: float = 0.0) -> torch.Tensor:
    return _attend(query, key, value, layer, scale, sliding_window, softcap).contiguous()


_library.impl("paged_attention", _attend_op, "CompositeExplicitAutograd")


@torch.library.register_fake("pagedserve::paged_attention")
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
      sliding_window: int, softcap: float = 0.0) -> torch.Tensor:
    return query.new_empty(query.shape)


paged_attention_op = torch.ops.pagedserve.paged_attention.default


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
                    sliding_window: int | None, softcap: float = 0.0) -> torch.Tensor:
    """query [T, H, D], key/value [T, KVH, D] -> [T, H, D]; writes key/value into layer `layer`'s cache.
    `softcap` > 0: attention scores soft-capped to tanh(s / softcap) * softcap (Gemma 2)."""
    window = sliding_window or 0
    if torch.compiler.is_compiling():
        return paged_attention_op(query, key, value, layer, scale, window, softcap)
    return _attend(query, key, value, layer, scale, window, softcap)
