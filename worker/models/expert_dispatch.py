"""The routed part of a mixture-of-experts MLP on a flattened token batch: each token's
top-k experts run on it and their outputs are summed with the routing weights.

Tokens are grouped by expert (one stable sort of the [T * k] expert choices per layer),
each active expert multiplies its rows in one matmul pair (gate/up with SiLU, then down,
through the packed CPU kernels where the expert's weights were packed, see packed_linear),
and each expert's weighted rows are index_add_-ed into the output in ascending expert
order: the order and dtypes of transformers' eager experts loop, so the sums round alike
(a routing weight in float32, as Mixtral's, multiplies in float32 before the cast back).

Which experts are active depends on the data, so under torch.compile the dispatch is one
opaque op, `pagedserve::moe_experts`, and the router and shared expert around it compile.
"""
from __future__ import annotations

import torch

from worker.models.packed_linear import linear, linear_silu


def mix_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, gate_up_packed: torch.Tensor | None,
                down_packed: torch.Tensor | None) -> torch.Tensor:
    """x [T, H], weights/experts [T, k] (routing weights, expert ids), gate_up [E, 2I, H]
    (gate rows, then up rows), down [E, H, I]; packed: the experts' packed copies stacked
    (or None) -> [T, H] in x's dtype."""
    num_experts = gate_up.shape[0]
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # the one host sync of the layer
    tokens = order // top_k
    rows = x[tokens]
    row_weights = weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        end = start + count
        activated = linear_silu(rows[start:end], gate_up[expert], None,
                                None if gate_up_packed is None else gate_up_packed[expert])
        y = linear(activated, down[expert], None, None if down_packed is None else down_packed[expert])
        out.index_add_(0, tokens[start:end], (y * row_weights[start:end]).to(out.dtype))
        start = end
    return out


# As worker.attention.step_context's op: a Library fragment, no autograd wrapper.
_library = torch.library.Library("pagedserve", "FRAGMENT")
_library.define("moe_experts(Tensor x, Tensor weights, Tensor experts, Tensor gate_up, Tensor down, "
                "Tensor? gate_up_packed, Tensor? down_packed) -> Tensor")
_library.impl("moe_experts", mix_experts, "CompositeExplicitAutograd")


@torch.library.register_fake("pagedserve::moe_experts")
def _(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
      gate_up_packed: torch.Tensor | None, down_packed: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, gate_up_packed: torch.Tensor | None,
                   down_packed: torch.Tensor | None) -> torch.Tensor:
    """`mix_experts`; inside a compiled graph through its opaque op."""
    if torch.compiler.is_compiling():
        return torch.ops.pagedserve.moe_experts.default(x, weights, experts, gate_up, down, gate_up_packed,
                                                        down_packed)
    return mix_experts(x, weights, experts, gate_up, down, gate_up_packed, down_packed)
