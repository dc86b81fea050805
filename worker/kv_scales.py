"""Per-layer K/V scales of an 8-bit KV cache, read from the checkpoint where it has them.

vLLM's names: compressed-tensors and fp8 checkpoints store `model.layers.N.self_attn.k_scale`
and `v_scale` (also under `self_attn.attn.`, `self_attn.k_proj.` / `v_proj.`, or as the
projections' `output_scale`); a single `kv_scale` serves both. Missing scales are 1.0.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

_SCALE_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.|k_proj\.|v_proj\.)?"
                         r"(k_scale|v_scale|kv_scale|output_scale)$")


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer, "k", "v" or "kv") for a checkpoint tensor holding a KV cache scale, else None."""
    match = _SCALE_NAME.match(name)
    if match is None:
        return None
    layer, kind = int(match.group(1)), match.group(2)
    if kind == "output_scale":
        projection = name.rsplit(".", 2)[-2]
        if projection not in ("k_proj", "v_proj"):
            return None
        return layer, projection[0]
    return layer, {"k_scale": "k", "v_scale": "v", "kv_scale": "kv"}[kind]


def read_kv_scales(files: list[Path], layers: range) -> list[tuple[float, float]]:
    """(k_scale, v_scale) of each layer in `layers` (1.0 where the checkpoint has none; a layer's own
    k/v scale over its shared kv_scale)."""
    from safetensors import safe_open

    found: dict[tuple[int, str], float] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                target = kv_scale_target(name)
                if target is None or target[0] not in layers:
                    continue
                tensor = f.get_tensor(name)
                if tensor.numel() != 1:
                    raise ValueError(f"checkpoint KV cache scale {name} has shape {tuple(tensor.shape)}; "
                                     "only per-tensor scales (one value) are supported")
                value = float(tensor.float())
                if not value > 0:
                    raise ValueError(f"checkpoint KV cache scale {name} must be positive, got {value}")
                found[target] = value
    if found:
        logger.info("KV cache scales from the checkpoint: %d tensors", len(found))
    return [tuple(found.get((layer, which), found.get((layer, "kv"), 1.0)) for which in "kv")  # type: ignore[misc]
            for layer in layers]
