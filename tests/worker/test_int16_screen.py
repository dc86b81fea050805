"""The screened greedy lm_head (int16 products, exact columns computed again) picks exactly the
token the float32 packed argmax picks: at model and odd sizes, on planted exact and near ties,
with outlier dimensions, and through its fallbacks."""
from __future__ import annotations

import pytest
import torch

from worker.kernels import cpu_extension, cpu_ops
from worker.models import packed_linear
from worker.lm_head.int16_screen import build_int16_screen, weight_levels

module = cpu_ops.load()
# A failed build is no reason to skip (test_cpu_kernel_build fails instead): only no compiler or another CPU.
needs_screen = pytest.mark.skipif(not cpu_extension.expected() or (module is not None and (
                                  not module.screened_argmax_available() or not module.f32_linear_available())),
                                  reason="needs the C++ kernel on a CPU with AVX512-VNNI")


def both(weight: torch.Tensor, x: torch.Tensor) -> tuple[list[int], list[int]]:
    packed = packed_linear.pack_weight(weight)
    screen = build_int16_screen(weight)
    assert screen is not None
    plain = torch.ops.pagedserve.packed_linear_argmax(x, packed, weight.shape[0])
    return screen.argmax(x, packed).tolist(), plain.tolist()


@needs_screen
@pytest.mark.parametrize("out_features, in_features, rows", [(49152, 576, 64), (1000, 37, 5), (333, 64, 300),
                                                             (4099, 2048, 9)])
def test_screened_argmax_is_the_packed_argmax(out_features, in_features, rows):
    g = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=g) * 0.05
    x = torch.randn(rows, in_features, generator=g)
    x[:, 3] *= 40  # an outlier dimension, as final hidden states have: a coarse row scale
    weight[7] = weight[5]  # an exact tie (the first column wins) ...
    weight[9] = weight[5] * (1 + 2**-20)  # ... and near ties, closer than any int16 bound
    weight[out_features - 1] = weight[5] * (1 - 2**-22)
    x[0] = weight[5] * 100  # a row whose argmax is in the planted group
    screened, plain = both(weight, x)
    assert screened == plain


@needs_screen
def test_rows_without_a_scale_fall_back_to_the_plain_argmax():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 40, generator=g)
    x = torch.randn(4, 40, generator=g)
    x[1] = 0.0  # every logit 0: column 0
    screened, plain = both(weight, x)
    assert screened == plain and screened[1] == 0
    x[2, 5] = float("nan")  # NaN logits: the plain kernel's rule (the first NaN)
    screened, plain = both(weight, x)
    assert screened == plain


@needs_screen
def test_screen_only_for_float32_weights_it_can_bound():
    assert build_int16_screen(torch.randn(64, 32).bfloat16()) is None
    weight = torch.randn(64, 32)
    weight[3, 4] = float("inf")
    assert build_int16_screen(weight) is None
    assert build_int16_screen(torch.randn(64, 40000)) is None  # too few int16 levels left for W
    assert weight_levels(576) == 1023 and 64 <= weight_levels(4096) < 1023


@needs_screen
def test_all_zero_weight_columns_are_exact():
    weight = torch.zeros(50, 16)
    weight[20] = 1.0
    x = torch.ones(2, 16)
    x[1] = -1.0  # every nonzero logit negative: the first zero column, 0
    screened, plain = both(weight, x)
    assert screened == plain == [20, 0]
