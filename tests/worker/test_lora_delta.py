"""The batched LoRA op (`worker.lora_slots.lora_add`) against a per-token reference: each token's
y row plus x_t A^T B^T of its own adapter (as lora_weights laid it out), on every path of the op
(all slots at once with a mask, by token group, one adapter for every token, no adapter), with
tokens on no adapter, adapters of a rank below max_rank and adapters on some modules only."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from common.config import EngineConfig
from common.lora_request import LoRARequest
from peft_adapters import ALL_LINEAR, build_peft_adapter
from tiny_models import build_tiny_hf_model
from worker import lora_slots
from worker.lora_slots import MODULE_IDS, LoRASlots, lora_add
from worker.lora_weights import FUSED_MODULES, module_shapes
from worker.model_loader import load_model

MAX_RANK = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_delta")
    build_tiny_hf_model("LlamaForCausalLM", root / "base")
    specs = {"r8": (8, ALL_LINEAR), "r4": (4, ALL_LINEAR), "attn": (8, ["q_proj", "v_proj", "o_proj"])}
    requests = {}
    for i, (name, (rank, targets)) in enumerate(specs.items()):
        build_peft_adapter(root / "base", root / name, rank=rank, targets=targets, seed=i + 1)
        requests[name] = LoRARequest(name, i + 1, str(root / name))
    model, _, _ = load_model(EngineConfig(model=str(root / "base")), "cpu", torch.float32)
    return model, requests


def reference(y, x, adapters, token_adapters, layer, module):
    """y + each token's delta, one token at a time from the adapter's own A and B."""
    out = y.clone()
    for t, name in enumerate(token_adapters):
        pair = None if name is None else adapters[name].weights[layer].get(module)
        if pair is not None:
            a, b = pair
            out[t] += (x[t:t + 1] @ a.t() @ b.t())[0]
    return out


def run_step(slots, requests, token_adapters, spans, all_slots_max):
    """lora_add of every layer and module for a step whose requests hold `spans` tokens each."""
    scheduled, start = [], 0
    for n in spans:
        name = token_adapters[start]
        scheduled.append((SimpleNamespace(lora_request=None if name is None else requests[name]), n))
        start += n
    shapes = module_shapes(slots.model.sizes)
    generator = torch.Generator().manual_seed(len(token_adapters))
    previous = lora_slots.ALL_SLOTS_MAX_TOKENS
    lora_slots.ALL_SLOTS_MAX_TOKENS = all_slots_max
    try:
        with slots.step(scheduled):
            step = lora_slots._current
            for layer in range(slots.num_layers):
                for module in FUSED_MODULES:
                    in_features, out_rows = shapes[module]
                    x = torch.randn(start, in_features, generator=generator)
                    y = torch.randn(start, sum(out_rows), generator=generator)
                    got = lora_add(y, x, layer, module)
                    adapters = {name: slots.loaded[name] for name in requests if name in slots.loaded}
                    torch.testing.assert_close(got, reference(y, x, adapters, token_adapters, layer, module),
                                               rtol=1e-5, atol=1e-5)
            return step
    finally:
        lora_slots.ALL_SLOTS_MAX_TOKENS = previous


@pytest.mark.parametrize("path", ["all_slots", "groups"])
def test_mixed_step_matches_reference(setup, path):
    model, requests = setup
    slots = LoRASlots(model, max_loras=4, max_cpu_loras=4, max_rank=MAX_RANK)
    rng = random.Random(3)
    names = [None, "r8", "r4", "attn", "r8", None, "attn", "r4", "r4"]
    spans = [rng.randint(1, 4) for _ in names]
    token_adapters = [name for name, n in zip(names, spans) for _ in range(n)]
    step = run_step(slots, requests, token_adapters, spans, all_slots_max=10 ** 6 if path == "all_slots" else 0)
    assert len(step.groups) == 3 and step.num_slots == 3
    assert bool(step.masks) == (path == "all_slots")
    # A slot left free below a used one: the all-slots path multiplies by its (zero) stacks too.
    slots.remove("r8")
    step = run_step(slots, requests, [n if n != "r8" else None for n in token_adapters], spans,
                    all_slots_max=10 ** 6 if path == "all_slots" else 0)
    assert {slot for slot, _ in step.groups} == {1, 2} and step.num_slots == 3


def test_one_adapter_and_none(setup):
    model, requests = setup
    slots = LoRASlots(model, max_loras=2, max_cpu_loras=2, max_rank=MAX_RANK)
    step = run_step(slots, requests, ["r4"] * 5, [2, 3], all_slots_max=10 ** 6)
    assert [index for _, index in step.groups] == [None] and not step.masks
    step = run_step(slots, requests, [None] * 4, [4], all_slots_max=10 ** 6)
    assert step.groups == []
    # Outside a step (the base model alone) y comes back unchanged, as a new tensor.
    y = torch.randn(3, 4)
    got = lora_add(y, torch.randn(3, 2), 0, "o")
    assert torch.equal(got, y) and got.data_ptr() != y.data_ptr()
    assert MODULE_IDS["o"] == FUSED_MODULES.index("o")
