"""`--quantization gguf`: a .gguf model's layers multiplied in their quantized blocks.

The model is loaded as usual from the dequantized conversion (norms, biases, embeddings); then
each layer's matmul weights whose GGUF types are multiplied quantized (gguf_packing) are read
again from the .gguf file, row-ordered as the conversion orders them (q/k rows un-permuted: the
blocks run along K, so moving rows moves whole blocks), and packed for `pagedserve::gguf_linear`
in place of the layer's packed copy; their float weights are dropped. Weights of other types keep
the dequantized packing. The lm_head and the embeddings stay dequantized (worker.lm_head).
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np
import torch
from torch import nn

from common.gguf_convert import unpermute_rotary_rows
from worker.models.packed_linear import pack_gated, pack_weight
from worker.quantization.gguf_directory import read_gguf_directory
from worker.quantization.gguf_packing import QUANTIZED_TYPES, QuantRows, concat_rows, pack, pack_gated_rows, unpack_tensor

logger = logging.getLogger(__name__)

# A layer's packed weight -> the GGUF tensors whose rows it stacks.
LAYER_PARTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
               "down": ("ffn_down",)}
# phi3 files store them fused: attn_qkv, and ffn_up with the gate rows then the up rows.
FUSED_LAYER_PARTS = {"qkv": ("attn_qkv",), "o": ("attn_output",), "gate_up": ("ffn_up",), "down": ("ffn_down",)}


class GGUFTensors:
    """The quantized tensors of one .gguf file, as QuantRows in the conversion's row order."""

    def __init__(self, path: str, num_heads: int, num_kv_heads: int):
        directory = read_gguf_directory(path)
        self.tensors = directory.tensors
        arch = directory.metadata.get("general.architecture")
        # As gguf_convert.hf_tensors: only llama-arch files carry the rotary permutation.
        self.permuted = {"attn_q": num_heads, "attn_k": num_kv_heads} if arch == "llama" else {}

    def type_name(self, name: str) -> str:
        tensor = self.tensors.get(name)
        return tensor.tensor_type.name if tensor is not None else "missing"

    def rows(self, name: str) -> QuantRows | None:
        """`name`'s quantized rows, or None when its type is not multiplied quantized."""
        tensor = self.tensors.get(name)
        if tensor is None or tensor.tensor_type not in QUANTIZED_TYPES:
            return None
        cols = int(tensor.shape[0])
        rows = int(np.prod(tensor.shape[1:]))
        quant = unpack_tensor(tensor.data, tensor.tensor_type, rows, cols)
        part = name.split(".")[2]
        if part in self.permuted:
            quant = quant.permute_rows(lambda a: unpermute_rotary_rows(a, self.permuted[part]))
        return quant


def _stub(weight: torch.Tensor) -> nn.Parameter:
    """A stand-in of `weight`'s shape and dtype holding no memory (the packed copy is multiplied)."""
    return nn.Parameter(torch.zeros(1, dtype=weight.dtype).expand(weight.shape), requires_grad=False)


def quantize_layers(model: Any, gguf_path: str) -> Counter:
    """Pack `model`'s layers (this pipeline stage's, one tensor-parallel rank) from `gguf_path`;
    returns how many weights took each path ("Q4_1", ..., or "dequantized")."""
    config = model.config
    heads = config.num_attention_heads
    source = GGUFTensors(gguf_path, heads, getattr(config, "num_key_value_heads", None) or heads)
    used: Counter = Counter()
    fused = f"blk.{model.first_layer}.attn_qkv.weight" in source.tensors
    for local, layer in enumerate(model.layers):
        index = model.first_layer + local
        for name, parts in (FUSED_LAYER_PARTS if fused else LAYER_PARTS).items():
            weight = getattr(layer, name + "_weight")
            names = [f"blk.{index}.{part}.weight" for part in parts]
            quant = [source.rows(n) for n in names]
            if name == "gate_up" and len(quant) == 1 and quant[0] is not None:  # fused: split gate / up
                half = quant[0].q.shape[0] // 2
                quant = [quant[0].permute_rows(lambda a: a[:half]), quant[0].permute_rows(lambda a: a[half:])]
            if any(q is None for q in quant):
                used["dequantized"] += 1
                setattr(layer, name + "_packed", pack_gated(weight) if name == "gate_up" else pack_weight(weight))
                continue
            rows = sum(q.q.shape[0] for q in quant)
            if (rows, quant[0].q.shape[1]) != tuple(weight.shape):
                raise ValueError(f"GGUF tensors {names} hold [{rows}, {quant[0].q.shape[1]}], "
                                 f"the model's {name} weight is {list(weight.shape)}")
            packed = pack_gated_rows(*quant) if name == "gate_up" else pack(concat_rows(quant))
            setattr(layer, name + "_packed", packed)
            setattr(layer, name + "_weight", _stub(weight))
            used["+".join(sorted({source.type_name(n) for n in names}))] += 1
        layer.fused_rotary = model.rotary_kernel_fits()
    return used
