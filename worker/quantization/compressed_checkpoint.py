"""Pre-quantized W8A8 checkpoints in the compressed-tensors format (config.json
`quantization_config` with quant_method "compressed-tensors", as llm-compressor saves them and
vLLM loads them): each quantized linear's `weight` is int8 [N, K] and `weight_scale` its
float scales, [N, 1] (strategy "channel") or one value ("tensor"), with w = weight * scale;
symmetric, so no zero point (a `weight_zero_point` present must be all zeros); the input
activations quantized dynamically per token at run time, asymmetrically whether the scheme says
`symmetric` or not (the kernel's one scheme: each token's range in full, zero points folded in).

`split_scales` takes the scales out of the checkpoint's stream (the model's float weights then
receive the int8 values, which every float dtype holds exactly); `layer_scales` arranges them
as the fused layers' rows for `int8_weights.quantize_model`.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from common.errors import ConfigError

QUANT_METHOD = "compressed-tensors"
# HF projection -> the fused weight of our decoder layer that holds its rows.
FUSED = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv", "self_attn.o_proj": "o",
         "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up", "mlp.down_proj": "down"}
DROPPED_SUFFIXES = (".weight_zero_point", ".input_scale", ".input_zero_point")


def quantization_config(hf_config: Any) -> dict | None:
    """The checkpoint's compressed-tensors quantization_config, or None for a float checkpoint."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise ConfigError(f"checkpoint quantization {method!r} is not supported (only {QUANT_METHOD!r} W8A8 int8)")
    return qc


def check_w8a8(qc: dict) -> None:
    """Refuse (ConfigError) any compressed-tensors scheme other than W8A8 int8 with symmetric
    channel (or tensor) weight scales and dynamic per-token activations on every decoder linear."""
    def refuse(why: str) -> None:
        raise ConfigError(f"compressed-tensors checkpoint not supported: {why} (pagedserve loads W8A8 int8: "
                          "symmetric per-channel int8 weights, dynamic per-token int8 activations)")
    if qc.get("format") not in ("int-quantized", "naive-quantized"):
        refuse(f"format {qc.get('format')!r}")
    if qc.get("quantization_status", "compressed") != "compressed":
        refuse(f"quantization_status {qc.get('quantization_status')!r}")
    if qc.get("kv_cache_scheme"):
        refuse("a kv_cache_scheme")
    groups = qc.get("config_groups") or {}
    if not groups:
        refuse("no config_groups")
    for name, group in groups.items():
        weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
        if (weights.get("num_bits"), weights.get("type"), weights.get("symmetric", True)) != (8, "int", True) \
                or weights.get("strategy") not in ("channel", "tensor"):
            refuse(f"group {name}'s weights {weights}")
        # Symmetric or not, dynamic per-token activations run as the kernel's asymmetric ones.
        if (inputs.get("num_bits"), inputs.get("type"), inputs.get("dynamic")) != (8, "int", True) \
                or inputs.get("strategy") != "token":
            refuse(f"group {name}'s input activations {inputs or None}")
        if group.get("output_activations"):
            refuse(f"group {name} quantizes output activations")
    for ignored in qc.get("ignore") or []:
        if not ignored.split(":")[-1].endswith("lm_head"):
            refuse(f"ignored layer {ignored!r} (only the lm_head may stay float)")


def split_scales(weights: Iterable[tuple[str, torch.Tensor]],
                 scales: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors less the quantization parameters: `<module>.weight_scale` goes to
    `scales[<module>]`; zero points (checked zero) and static input scales are dropped."""
    for name, tensor in weights:
        if name.endswith(".weight_scale"):
            scales[name[:-len(".weight_scale")]] = tensor
        elif name.endswith(DROPPED_SUFFIXES):
            if name.endswith("zero_point") and bool(tensor.ne(0).any()):
                raise ConfigError(f"{name}: asymmetric weights are not supported")
        else:
            yield name, tensor


def layer_scales(model: Any, scales: dict[str, torch.Tensor]) -> dict[tuple[int, str], torch.Tensor]:
    """float32 scales of every decoder layer's fused weights, by (layer position, fused name), from
    the checkpoint's per-projection scales; a tensor-parallel rank takes its rows (the scales of a
    row-parallel layer are per output channel: whole on every rank)."""
    out: dict[tuple[int, str], torch.Tensor] = {}
    for position, layer in enumerate(model.layers):
        for fused in ("qkv", "o", "gate_up", "down"):
            out[(position, fused)] = torch.full((getattr(layer, fused + "_weight").shape[0],), float("nan"))
    first = model.first_layer
    for name, (target, part) in model.weight_targets().items():
        if not name.startswith("model.layers.") or not name.endswith(".weight"):
            continue
        index, module = name.split(".")[2], ".".join(name.split(".")[3:-1])
        if module not in FUSED:
            continue
        prefix = f"model.layers.{index}.{module}"
        if prefix not in scales:
            raise ConfigError(f"compressed-tensors checkpoint: {prefix} has no weight_scale")
        scale = scales[prefix].to(torch.float32).reshape(-1)
        if scale.numel() == 1:
            scale = scale.expand(target.shape[0] if part is None or part[0] != 0 else part[2]).clone()
        elif part is not None and part[0] == 0:  # column-parallel: this rank's output channels
            scale = scale.narrow(0, part[1], part[2])
        row = target.storage_offset() // target.stride(0)  # where the projection sits in the fused weight
        out[(int(index) - first, FUSED[module])][row:row + target.shape[0]] = scale
    for key, scale in out.items():
        if bool(scale.isnan().any()):
            raise ConfigError(f"compressed-tensors checkpoint: missing scales for layer {key[0]}'s {key[1]}")
    return out
