"""The RMSNorm of the CPU kernel extension (`pagedserve::rms_norm`, `pagedserve::add_rms_norm`)
computes transformers' LlamaRMSNorm as eager PyTorch does: in bfloat16 the sum is eager's bit
for bit and the norm too up to the order in which a row's squares add up; compiled graphs call
it; bad arguments are refused with a message."""
from __future__ import annotations

import pytest
import torch

from worker.attention import cpu_kernels
from worker.benchmarks.throughput import greedy_params
from worker.llm import LLM
from worker.models.norm import add_norm, norm, rms_norm
from tests.tiny_models import build_tiny_hf_model

module = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(module is None, reason="needs the C++ kernel extension")
BF16_STEP = 2.0**-7  # spacing of bfloat16 values relative to their magnitude (at most)


def operands(rows: int, dim: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    residual = (torch.randn(rows, dim, generator=g) * 4).to(dtype)
    residual[:, :3] *= 30  # outlier channels, as hidden states have
    return residual, torch.randn(rows, dim, generator=g).to(dtype), (torch.rand(dim, generator=g) + 0.5).to(dtype)


@needs_kernels
@pytest.mark.parametrize("rows, dim", [(256, 576), (3, 38), (257, 2048), (1, 64), (0, 576)])
def test_bfloat16_norm_is_eagers(rows, dim):
    residual, delta, weight = operands(rows, dim, torch.bfloat16, seed=rows + dim)
    hidden, normed = add_norm(residual, delta, weight, 1e-5, fused=True)
    expected_hidden, expected = add_norm(residual, delta, weight, 1e-5, fused=False)
    assert torch.equal(hidden, expected_hidden)
    for got, want in ((normed, expected), (norm(residual, weight, 1e-5, fused=True), rms_norm(residual, weight, 1e-5))):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert (got != want).sum() <= got.numel() // 1000  # a rounding flipped by the summation order
        assert ((got.float() - want.float()).abs() <= want.float().abs() * BF16_STEP).all()


@needs_kernels
def test_float32_norm_is_eagers_to_rounding():
    residual, delta, weight = operands(64, 576, torch.float32, seed=1)
    hidden, normed = add_norm(residual, delta, weight, 1e-6, fused=True)
    expected_hidden, expected = add_norm(residual, delta, weight, 1e-6, fused=False)
    assert torch.equal(hidden, expected_hidden)
    torch.testing.assert_close(normed, expected, rtol=1e-6, atol=0)
    single_row = residual[0]  # 1-D
    torch.testing.assert_close(norm(single_row, weight, 1e-6, fused=True), rms_norm(single_row, weight, 1e-6),
                               rtol=1e-6, atol=0)


@needs_kernels
def test_compiled_graph_calls_the_kernel():
    residual, delta, weight = operands(40, 96, torch.bfloat16, seed=2)

    def step(residual, delta):
        hidden, x = add_norm(residual, delta, weight, 1e-5, fused=True)
        return hidden, norm(x, weight, 1e-5, fused=True)

    compiled = torch.compile(step, dynamic=True, fullgraph=True)
    for got, want in zip(compiled(residual, delta), step(residual, delta)):
        assert torch.equal(got, want)


@needs_kernels
def test_bad_arguments_are_refused_with_a_message():
    residual, delta, weight = operands(4, 64, torch.bfloat16, seed=3)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.pagedserve.rms_norm(residual, weight[:32], 1e-5)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.pagedserve.rms_norm(residual, weight.float(), 1e-5)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        torch.ops.pagedserve.rms_norm(residual.half(), weight.half(), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.pagedserve.rms_norm(residual.t(), weight[:4], 1e-5)
    with pytest.raises(RuntimeError, match="delta must match"):
        torch.ops.pagedserve.add_rms_norm(residual, delta[:2], weight, 1e-5)


@needs_kernels
def test_bfloat16_engine_takes_its_norms_through_the_kernel(tmp_path):
    """A bf16 engine on a kernel-capable CPU uses the kernel for its norms, and its greedy tokens are
    those of the same engine with torch's norms (eager both)."""
    if not cpu_kernels.packed_linear_available(torch.bfloat16):
        pytest.skip("the packed bfloat16 path needs AVX512-BF16")
    directory = tmp_path / "tiny"
    build_tiny_hf_model("LlamaForCausalLM", directory)
    llm = LLM(model=str(directory), dtype="bfloat16", enforce_eager=True, block_size=4,
              num_gpu_blocks_override=256, skip_tokenizer_init=True)
    layers = llm.worker.model.layers
    assert all(layer.fused_norm for layer in layers)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 256 for j in range(5 + 3 * i)]} for i in range(6)]
    fused = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, greedy_params(12), use_tqdm=False)]
    for layer in layers:
        layer.fused_norm = False
    plain = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, greedy_params(12), use_tqdm=False)]
    assert fused == plain
