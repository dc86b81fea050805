"""Multi-LoRA on the worker: adapters loaded (LRU), device slots, and the batched delta op.

Every decoder layer of a LoRA-enabled model adds `lora_delta(x, layer, module)` to the output
of its four fused matmuls (qkv, o, gate_up, down; see worker.lora_weights), never merging an
adapter into the base weights (which may be packed for the CPU kernel). The adapters of one
step sit in `max_loras` device slots, each slot's A and B in stacked tensors per layer and
module; a step's tokens are grouped by slot (one index tensor per slot in use), and each
group's delta is two matmuls on its gathered rows, copied back into place: the batch mixes
adapters and the base model, computed adapter by adapter, never request by request.

As attention (worker.attention.step_context), the delta reads the step's state (the token
groups and the stacks) from a context the worker opens around the forward pass, and under
torch.compile it is the opaque custom op `pagedserve::lora_delta`, so one compiled graph
serves every mix of adapters.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from common.errors import ConfigError
from common.lora_request import LoRARequest
from worker.lora_weights import FUSED_MODULES, MODULE_PARTS, LoRAAdapter, LoRAAdapterError, load_adapter, module_shapes

MODULE_IDS = {name: i for i, name in enumerate(FUSED_MODULES)}  # the op's `module` argument


@dataclass(slots=True)
class LoRAStep:
    stacks: list[list[tuple[torch.Tensor, torch.Tensor]]]  # [layer][module] -> (A [S, P*R, in], B [S, out, P*R])
    groups: list[tuple[int, torch.Tensor | None]]  # (slot, token indices; None: every token)


_current: LoRAStep | None = None


def _delta(x: torch.Tensor, layer: int, module: int, out_features: int) -> torch.Tensor:
    out = x.new_zeros(x.shape[0], out_features)
    step = _current
    if step is None:
        return out
    a_stack, b_stack = step.stacks[layer][module]
    for slot, index in step.groups:
        if index is None:  # every token on one adapter
            return torch.mm(torch.mm(x, a_stack[slot].t()), b_stack[slot].t())
        rows = x.index_select(0, index)
        out.index_copy_(0, index, torch.mm(torch.mm(rows, a_stack[slot].t()), b_stack[slot].t()))
    return out


_library = torch.library.Library("pagedserve", "FRAGMENT")
_library.define("lora_delta(Tensor x, SymInt layer, SymInt module, SymInt out_features) -> Tensor")
_library.impl("lora_delta", _delta, "CompositeExplicitAutograd")


@torch.library.register_fake("pagedserve::lora_delta")
def _(x: torch.Tensor, layer: int, module: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


lora_delta_op = torch.ops.pagedserve.lora_delta.default


def lora_delta(x: torch.Tensor, layer: int, module: str, out_features: int) -> torch.Tensor:
    """x [T, in] -> [T, out_features]: each token's adapter delta of `module` (zero without one)."""
    if torch.compiler.is_compiling():
        return lora_delta_op(x, layer, MODULE_IDS[module], out_features)
    return _delta(x, layer, MODULE_IDS[module], out_features)


class LoRASlots:
    """The worker's adapters: up to `max_cpu_loras` loaded (least recently used dropped first),
    up to `max_loras` of them in device slots, which a step's adapters must fit."""

    def __init__(self, model: Any, max_loras: int, max_cpu_loras: int, max_rank: int):
        if getattr(getattr(type(model), "layers_function", None), "__name__", None) != "decoder_layers":
            raise ConfigError(f"enable_lora supports the Llama-family decoders (Llama, Mistral, Qwen2/3 and "
                              f"their MoE variants, attention only), not {type(model).__name__}")
        self.model = model
        self.max_loras, self.max_cpu_loras, self.max_rank = max_loras, max_cpu_loras, max_rank
        self.num_layers = len(model.layers)
        self.has_dense_mlp = all(layer.mlp is None for layer in model.layers)
        dtype, device = model.dtype, model.device
        self.stacks: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        shapes = module_shapes(model.sizes)
        for _ in range(self.num_layers):
            per_module = []
            for name in FUSED_MODULES:
                in_features, out_rows = shapes[name]
                width = len(MODULE_PARTS[name]) * max_rank
                per_module.append((torch.zeros(max_loras, width, in_features, dtype=dtype, device=device),
                                   torch.zeros(max_loras, sum(out_rows), width, dtype=dtype, device=device)))
            self.stacks.append(per_module)
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # name -> adapter (CPU), LRU order
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # name -> device slot, LRU order
        self.sources: dict[str, LoRARequest] = {}  # name -> the request its loaded adapter was read for
        for layer in model.layers:
            layer.lora_enabled = True

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of `request`, read from its path unless loaded (LoRAAdapterError if unusable)."""
        adapter = self.loaded.get(request.lora_name)
        if adapter is not None and self.sources.get(request.lora_name) != request:  # the name reloaded
            self.remove(request.lora_name)  # (another path, or a new id: its files may have changed)
            adapter = None
        if adapter is None:
            adapter = load_adapter(request.lora_name, request.lora_path, self.model.sizes, self.num_layers,
                                   self.max_rank, self.model.dtype, self.has_dense_mlp)
            self.loaded[request.lora_name] = adapter
            self.sources[request.lora_name] = request
            while len(self.loaded) > self.max_cpu_loras:
                evicted = next(name for name in self.loaded if name != request.lora_name)
                self.remove(evicted)
        self.loaded.move_to_end(request.lora_name)
        return adapter

    def remove(self, name: str) -> bool:
        """Forget adapter `name` (a later request with it loads it again); whether it was loaded."""
        self.slot_of.pop(name, None)
        self.sources.pop(name, None)
        return self.loaded.pop(name, None) is not None

    def _slot(self, adapter: LoRAAdapter, in_use: set[int]) -> int:
        slot = self.slot_of.get(adapter.name)
        if slot is None:
            free = sorted(set(range(self.max_loras)) - set(self.slot_of.values()))
            if free:
                slot = free[0]
            else:  # the least recently used slot no adapter of this step holds
                victim = next((name for name, s in self.slot_of.items() if s not in in_use), None)
                if victim is None:
                    raise ValueError(f"a step needs more than max_loras={self.max_loras} adapters")
                slot = self.slot_of.pop(victim)
            self._write(slot, adapter)
            self.slot_of[adapter.name] = slot
        self.slot_of.move_to_end(adapter.name)
        return slot

    @torch.no_grad()
    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        r, big_r = adapter.rank, self.max_rank
        for layer in range(self.num_layers):
            for m, name in enumerate(FUSED_MODULES):
                a_stack, b_stack = self.stacks[layer][m]
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                pair = adapter.weights[layer].get(name)
                if pair is None:
                    continue
                a, b = pair
                for part in range(len(MODULE_PARTS[name])):
                    a_stack[slot, part * big_r:part * big_r + r] = a[part * r:(part + 1) * r]
                    b_stack[slot, :, part * big_r:part * big_r + r] = b[:, part * r:(part + 1) * r]

    def step_groups(self, scheduled: Sequence[tuple[Any, int]]) -> list[tuple[int, torch.Tensor | None]]:
        """(slot, token indices) of every adapter among the scheduled (state, tokens) in batch order."""
        spans: dict[str, list[tuple[int, int]]] = {}
        requests: dict[str, LoRARequest] = {}
        start = 0
        for state, n in scheduled:
            request = state.lora_request
            if request is not None:
                spans.setdefault(request.lora_name, []).append((start, start + n))
                requests[request.lora_name] = request
            start += n
        if len(spans) > self.max_loras:
            raise ValueError(f"a step holds {len(spans)} adapters, more than max_loras={self.max_loras}")
        adapters = {name: self.load(requests[name]) for name in spans}
        in_use = {self.slot_of[name] for name in spans if name in self.slot_of}
        groups: list[tuple[int, torch.Tensor | None]] = []
        for name, ranges in spans.items():
            slot = self._slot(adapters[name], in_use)
            in_use.add(slot)
            if len(spans) == 1 and ranges == [(0, start)]:
                groups.append((slot, None))
            else:
                index = torch.cat([torch.arange(lo, hi) for lo, hi in ranges]).to(self.model.device)
                groups.append((slot, index))
        return groups

    @contextlib.contextmanager
    def step(self, scheduled: Sequence[tuple[Any, int]]) -> Iterator[None]:
        """Open the step's LoRA context around a forward pass of the `scheduled` batch."""
        global _current
        previous, _current = _current, LoRAStep(self.stacks, self.step_groups(scheduled))
        try:
            yield
        finally:
            _current = previous


__all__ = ["LoRAAdapterError", "LoRASlots", "lora_delta"]
