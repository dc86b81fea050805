"""Multi-LoRA on the worker: adapters loaded (LRU), device slots, and the batched LoRA op.

Every decoder layer of a LoRA-enabled model passes the output of its four fused matmuls (qkv,
o, gate_up, down; see worker.lora_weights) through `lora_add(y, x, layer, module)`, which adds
each token's adapter delta, never merging an adapter into the base weights (which may be packed
for the CPU kernel). The adapters of one step sit in `max_loras` device slots, each slot's A
[P*R, in] and B^T [P*R, out] in stacked tensors per layer and module. A step of few tokens per
adapter (decode) multiplies every token by the A of every slot in use, zeroes the columns of
the slots that are not the token's (a mask built once per step), and multiplies by every
slot's B^T added to y: three ops per module whatever the mix. A longer step (prefill) groups
its tokens by slot and runs each group's two matmuls on its gathered rows, added back in place.

As attention (worker.attention.step_context), the op reads the step's state (the groups, the
masks and the stacks) from a context the worker opens around the forward pass, and under
torch.compile it is the opaque custom op `pagedserve::lora_add`, so one compiled graph
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


# Steps of at most this many tokens per slot in use multiply every token by every slot's A and
# B at once (a few large matmuls: small ones cost mostly their fixed overhead, which dominates
# decode steps); longer steps (prefill) multiply each adapter's gathered tokens by its own.
ALL_SLOTS_MAX_TOKENS = 128


@dataclass(slots=True)
class LoRAStep:
    stacks: list[list[tuple[torch.Tensor, torch.Tensor]]]  # [layer][module] -> (A [S, P*R, in], B^T [S, P*R, out])
    groups: list[tuple[int, torch.Tensor | None]]  # (slot, token indices; None: every token)
    num_slots: int  # the step's adapters sit in slots 0 .. num_slots - 1
    masks: dict[int, torch.Tensor]  # width P*R -> [T, num_slots * P*R], 1 on a token's own slot; {}: by group


_current: LoRAStep | None = None


def step_masks(groups: list[tuple[int, torch.Tensor | None]], num_tokens: int, widths: set[int],
               dtype: torch.dtype, device: torch.device) -> tuple[int, dict[int, torch.Tensor]]:
    """(num_slots, masks) of a step for the all-slots path (see ALL_SLOTS_MAX_TOKENS); no masks
    for a step by group: one adapter for every token, or many tokens per slot."""
    num_slots = 1 + max((slot for slot, _ in groups), default=-1)
    if not groups or groups[0][1] is None or num_tokens > ALL_SLOTS_MAX_TOKENS * len(groups):
        return num_slots, {}
    token_slot = torch.full((num_tokens,), -1, dtype=torch.long)
    for slot, index in groups:
        token_slot[index.cpu()] = slot
    token_slot = token_slot.to(device)
    return num_slots, {width: (torch.arange(num_slots * width, device=device) // width == token_slot[:, None]).to(dtype)
                       for width in widths}


def _lora_add(y: torch.Tensor, x: torch.Tensor, layer: int, module: int) -> torch.Tensor:
    step = _current
    if step is None or not step.groups:
        return y.clone()
    a_stack, bt_stack = step.stacks[layer][module]
    width = a_stack.shape[1]
    mask = step.masks.get(width)
    if mask is not None:  # every slot's A, the other slots' columns zeroed, then every slot's B
        n = step.num_slots
        h = torch.mm(x, a_stack[:n].reshape(n * width, -1).t()).mul_(mask)
        return torch.addmm(y, h, bt_stack[:n].reshape(n * width, -1))
    slot, index = step.groups[0]
    if index is None:  # every token on one adapter
        return torch.addmm(y, torch.mm(x, a_stack[slot].t()), bt_stack[slot])
    out = y.clone()
    for slot, index in step.groups:
        rows = x.index_select(0, index)
        out.index_add_(0, index, torch.mm(torch.mm(rows, a_stack[slot].t()), bt_stack[slot]))
    return out


_library = torch.library.Library("pagedserve", "FRAGMENT")
_library.define("lora_add(Tensor y, Tensor x, SymInt layer, SymInt module) -> Tensor")
_library.impl("lora_add", _lora_add, "CompositeExplicitAutograd")


@torch.library.register_fake("pagedserve::lora_add")
def _(y: torch.Tensor, x: torch.Tensor, layer: int, module: int) -> torch.Tensor:
    return y.new_empty(y.shape)


lora_add_op = torch.ops.pagedserve.lora_add.default


def lora_add(y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> torch.Tensor:
    """y [T, out] (the output of `module` for the input x [T, in]) plus each token's adapter
    delta of `module` (nothing without one), as a new tensor."""
    if torch.compiler.is_compiling():
        return lora_add_op(y, x, layer, MODULE_IDS[module])
    return _lora_add(y, x, layer, MODULE_IDS[module])


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
                                   torch.zeros(max_loras, width, sum(out_rows), dtype=dtype, device=device)))
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
                    b_stack[slot, part * big_r:part * big_r + r] = b[:, part * r:(part + 1) * r].t()

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
            if len(spans) == 1 and sum(hi - lo for lo, hi in ranges) == start:  # every token
                groups.append((slot, None))
            else:
                index = torch.cat([torch.arange(lo, hi) for lo, hi in ranges]).to(self.model.device)
                groups.append((slot, index))
        return groups

    @contextlib.contextmanager
    def step(self, scheduled: Sequence[tuple[Any, int]]) -> Iterator[None]:
        """Open the step's LoRA context around a forward pass of the `scheduled` batch."""
        global _current
        groups = self.step_groups(scheduled)
        widths = {len(parts) * self.max_rank for parts in MODULE_PARTS.values()}
        num_slots, masks = step_masks(groups, sum(n for _, n in scheduled), widths, self.model.dtype,
                                      self.model.device)
        previous, _current = _current, LoRAStep(self.stacks, groups, num_slots, masks)
        try:
            yield
        finally:
            _current = previous


__all__ = ["LoRAAdapterError", "LoRASlots", "lora_add"]
