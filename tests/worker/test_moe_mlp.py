"""The mixture-of-experts MLP's pieces: the grouped expert dispatch against a per-token
reference, its packed CPU kernel path against plain matmuls, and the errors for
configurations it cannot serve. (Whole models against transformers: test_models.py.)"""
from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError
from common.parallel_layout import TensorShard
from worker.models.expert_dispatch import mix_experts
from worker.models.moe_mlp import MoeMlp, MoeSpec, route
from worker.models.packed_linear import packing_supported

HIDDEN, EXPERTS, COLS = 64, 6, 40


def random_moe(dtype: torch.dtype, shared: int = 0, seed: int = 0) -> MoeMlp:
    spec = MoeSpec(num_experts=EXPERTS, top_k=2, intermediate=COLS, normalize=False, weights_in_model_dtype=True,
                   shared_intermediate=shared)
    mlp = MoeMlp(spec, HIDDEN, TensorShard(), dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    for param in mlp.parameters():
        param.copy_(0.2 * torch.randn(param.shape, generator=g))
    return mlp


def test_dispatch_equals_per_token_reference() -> None:
    """Every token's output is the weighted sum of its own top-k experts, whatever the grouping."""
    mlp = random_moe(torch.float32)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    weights, experts = route(x, mlp.router_weight, mlp.spec)
    out = mix_experts(x, weights, experts, mlp.gate_up_weight, mlp.down_weight, None, None)
    for t in range(x.shape[0]):
        want = torch.zeros(HIDDEN)
        for w, e in zip(weights[t], experts[t]):
            gate, up = (mlp.gate_up_weight[e] @ x[t]).chunk(2)
            want += w * (mlp.down_weight[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)
    assert experts.unique().numel() > 2  # several experts were active


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_match_plain(dtype) -> None:
    mlp = random_moe(dtype, shared=24)
    if not packing_supported(mlp.gate_up_weight[0]):
        pytest.skip("the CPU kernel's packed matmul is not available here")
    x = torch.randn(21, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    plain = mlp(x)
    mlp.pack_weights()
    assert mlp.gate_up_packed is not None and mlp.shared_down_packed is not None
    for tokens in (x, x[:1]):  # a batch and a single decode row
        packed = mlp(tokens).float()
        reference = plain[:tokens.shape[0]].float()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert (packed - reference).abs().max() <= tolerance * reference.abs().max()


def test_bad_expert_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="num_experts_per_tok 5 must be between 1 and the number of experts 4"):
        MoeSpec(num_experts=4, top_k=5, intermediate=8, normalize=True, weights_in_model_dtype=False)
    spec = MoeSpec(num_experts=4, top_k=2, intermediate=3, normalize=True, weights_in_model_dtype=False)
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 exceeds the model's 3 expert MLP columns"):
        MoeMlp(spec, HIDDEN, TensorShard(0, 4), torch.float32, "cpu")


def test_int8_quantization_refuses_moe(tmp_path) -> None:
    from pagedserve.offline.llm import LLM
    from tiny_models import MOE_SIZES, build_tiny_hf_model

    build_tiny_hf_model("Qwen3MoeForCausalLM", tmp_path, **MOE_SIZES["Qwen3MoeForCausalLM"])
    with pytest.raises(ConfigError, match="--quantization int8 does not support mixture-of-experts models"):
        LLM(model=str(tmp_path), dtype="float32", quantization="int8", enforce_eager=True,
            num_gpu_blocks_override=32, skip_tokenizer_init=True)
