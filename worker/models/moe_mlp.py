"""The mixture-of-experts MLP of Mixtral, Qwen2-MoE and Qwen3-MoE layers, in place of the
dense SiLU MLP of the Llama layer (`DecoderLayer.mlp`).

As transformers' modeling code: router logits x @ W_r.T in the model dtype, softmax in
float32, top-k; the k weights renormalised to sum to one when `normalize` (Mixtral always,
Qwen when `norm_topk_prob`), and cast back to the model dtype for the Qwen models (Mixtral
keeps float32). Qwen2-MoE adds a dense shared expert scaled by sigmoid(x @ W_g.T).

Expert weights are stacked: gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I].
Under tensor parallelism each rank holds the same columns of every expert's intermediate
size (and of the shared expert's), as the dense MLP does; the router is whole on every
rank, the partial outputs are summed over the ranks once per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.parallel_layout import TensorShard
from worker.distributed.tensor_parallel import tp_all_reduce
from worker.models.expert_dispatch import routed_experts
from worker.models.packed_linear import linear, linear_silu, pack_gated, pack_weight, packing_supported


@dataclass(frozen=True)
class MoeSpec:
    """What differs between the architectures' sparse MLPs, read from their configs."""
    num_experts: int
    top_k: int
    intermediate: int  # columns of one expert
    normalize: bool  # renormalise the top-k weights to sum to one
    weights_in_model_dtype: bool  # cast the routing weights to the model dtype (Qwen) or keep float32
    shared_intermediate: int = 0  # columns of the shared expert (Qwen2-MoE); 0: none
    module: str = "mlp"  # checkpoint names: model.layers.N.<module>.gate / .experts.E.<gate|up|down>
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"mixture of experts: num_experts_per_tok {self.top_k} must be between 1 and "
                             f"the number of experts {self.num_experts}")
        if self.intermediate < 1:
            raise ValueError(f"mixture of experts: expert intermediate size {self.intermediate} must be positive")


def route(x: torch.Tensor, router_weight: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights [T, k], expert ids [T, k]) of each token's top-k experts."""
    logits = F.linear(x, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, spec.top_k, dim=-1)
    if spec.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.weights_in_model_dtype:
        weights = weights.to(logits.dtype)
    return weights, experts


def _param(*shape: int, dtype: torch.dtype | None, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class MoeMlp(nn.Module):
    def __init__(self, spec: MoeSpec, hidden: int, shard: TensorShard, dtype: torch.dtype | None, device):
        super().__init__()
        self.spec = spec
        self.tensor_parallel = shard.size > 1
        self.start, cols = shard.split(spec.intermediate, "expert MLP columns (moe_intermediate_size)")
        self.router_weight = _param(spec.num_experts, hidden, dtype=dtype, device=device)
        self.gate_up_weight = _param(spec.num_experts, 2 * cols, hidden, dtype=dtype, device=device)
        self.down_weight = _param(spec.num_experts, hidden, cols, dtype=dtype, device=device)
        self.shared_start, shared_cols = (shard.split(spec.shared_intermediate, "shared expert MLP columns")
                                          if spec.shared_intermediate else (0, 0))
        self.shared_gate_up_weight = self.shared_down_weight = self.shared_gate_weight = None
        if shared_cols:
            self.shared_gate_up_weight = _param(2 * shared_cols, hidden, dtype=dtype, device=device)
            self.shared_down_weight = _param(hidden, shared_cols, dtype=dtype, device=device)
            self.shared_gate_weight = _param(1, hidden, dtype=dtype, device=device)
        # Packed copies for the CPU kernel (pack_weights); None: plain F.linear.
        for name in ("gate_up", "down", "shared_gate_up", "shared_down"):
            self.register_buffer(name + "_packed", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (post-attention-normed) -> the MLP output [T, hidden], summed over the ranks."""
        weights, experts = route(x, self.router_weight, self.spec)
        out = routed_experts(x, weights, experts, self.gate_up_weight, self.down_weight, self.gate_up_packed,
                             self.down_packed)
        if self.shared_gate_up_weight is not None:
            shared = linear(linear_silu(x, self.shared_gate_up_weight, None, self.shared_gate_up_packed),
                            self.shared_down_weight, None, self.shared_down_packed)
            out = out + torch.sigmoid(F.linear(x, self.shared_gate_weight)) * shared
        return tp_all_reduce(out) if self.tensor_parallel else out

    def pack_weights(self) -> None:
        """Each expert's weights packed for the CPU kernel, stacked [E, ...] (see packed_linear)."""
        if not packing_supported(self.gate_up_weight[0]):
            return
        self.gate_up_packed = torch.stack([pack_gated(w) for w in self.gate_up_weight])
        self.down_packed = torch.stack([pack_weight(w) for w in self.down_weight])
        if self.shared_gate_up_weight is not None:
            self.shared_gate_up_packed = pack_gated(self.shared_gate_up_weight)
            self.shared_down_packed = pack_weight(self.shared_down_weight)

    def weight_targets(self, prefix: str) -> dict[str, tuple[torch.Tensor, tuple[int, int, int] | None]]:
        """Checkpoint name (under `prefix`, "model.layers.N.") -> (tensor it is copied into, this
        rank's part of the checkpoint tensor: (dim, start, length), None for all of it)."""
        spec = self.spec
        p = f"{prefix}{spec.module}."
        gate, up, down = spec.expert_names
        cols = self.down_weight.shape[2]
        column_part = (0, self.start, cols) if self.tensor_parallel else None
        row_part = (1, self.start, cols) if self.tensor_parallel else None
        targets = {p + "gate.weight": (self.router_weight, None)}
        for e in range(spec.num_experts):
            expert = f"{p}experts.{e}."
            targets[expert + gate + ".weight"] = (self.gate_up_weight[e, :cols], column_part)
            targets[expert + up + ".weight"] = (self.gate_up_weight[e, cols:], column_part)
            targets[expert + down + ".weight"] = (self.down_weight[e], row_part)
        if self.shared_gate_up_weight is not None:
            shared_cols = self.shared_down_weight.shape[1]
            part = (0, self.shared_start, shared_cols) if self.tensor_parallel else None
            targets[p + "shared_expert.gate_proj.weight"] = (self.shared_gate_up_weight[:shared_cols], part)
            targets[p + "shared_expert.up_proj.weight"] = (self.shared_gate_up_weight[shared_cols:], part)
            targets[p + "shared_expert.down_proj.weight"] = (
                self.shared_down_weight, (1, self.shared_start, shared_cols) if self.tensor_parallel else None)
            targets[p + "shared_expert_gate.weight"] = (self.shared_gate_weight, None)
        return targets
