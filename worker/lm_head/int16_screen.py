"""The float32 lm_head whose greedy rows go through an int16 screen
(`screened_argmax` in `worker/csrc/lm_head_argmax.cpp`): the tokens of
`packed_argmax`, with most columns never computed in float32.

W [N, K] is scaled per column into int16 and packed like a bfloat16 weight
([ceil(N / 16), ceil(K / 2), 16, 2], the operand layout of `vpdpwssd`), with
each column's scale, its largest rounding error and its l1 norm, which bound
how far the int16 logits can be from the float32 ones.

The int32 accumulators must not overflow: K x 2047 (a row of x) x levels of W
stays below 2^31, which leaves W 1023 levels up to K = 1025 and fewer beyond
(looser bounds, more columns to compute again); below 64 levels, or without
AVX512-VNNI, there is no screen and `packed_argmax` is chosen instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.kernels import cpu_ops
from worker.lm_head.packed_argmax import PackedArgmaxLmHead
from worker.models.packed_linear import panels

ROW_LEVELS = 2047  # SCREEN_ROW_LEVELS in the C++ source
MAX_WEIGHT_LEVELS = 1023
MIN_WEIGHT_LEVELS = 64


@dataclass(frozen=True, slots=True)
class Int16Screen:
    packed: torch.Tensor  # int16 [ceil(N / 16), ceil(K / 2), 16, 2]
    col_scale: torch.Tensor  # float32 [N]
    col_error: torch.Tensor  # largest |W - scale q| of each column, rounded up
    col_l1: torch.Tensor  # ||W_n||_1, rounded up
    weight: torch.Tensor  # the float32 lm_head [N, K], for the columns computed again

    def argmax(self, hidden: torch.Tensor, float_packed: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of hidden @ W.T, as `pagedserve::packed_linear_argmax` gives it."""
        module = cpu_ops.load()
        return module.screened_argmax(hidden, self.packed, self.col_scale, self.col_error, self.col_l1,
                                      self.weight, float_packed, self.weight.shape[0])


def weight_levels(in_features: int) -> int:
    padded = in_features + in_features % 2
    return min(MAX_WEIGHT_LEVELS, (2**31 - 1) // (padded * ROW_LEVELS))


def build_int16_screen(weight: torch.Tensor) -> Int16Screen | None:
    """The screen of a float32 CPU lm_head [N, K], or None where it cannot run or help."""
    module = cpu_ops.load() if weight.device.type == "cpu" else None
    if (module is None or weight.dtype != torch.float32 or weight.dim() != 2
            or not module.screened_argmax_available() or not torch.isfinite(weight).all()):
        return None
    k = weight.shape[1]
    levels = weight_levels(k)
    if levels < MIN_WEIGHT_LEVELS:
        return None
    w64 = weight.detach().double()
    top = w64.abs().amax(dim=1)
    scale = (top / levels).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero column: q = 0, exact
    s64 = scale.double()[:, None]
    q = torch.round(w64 / s64).clamp_(-levels, levels)
    error = (w64 - s64 * q).abs().amax(dim=1)
    l1 = w64.abs().sum(dim=1)
    packed = panels(q.to(torch.int16), 2)  # int16 pairs: vpdpwssd's operand layout
    round_up = 1 + 1e-6
    return Int16Screen(packed, scale.contiguous(), (error * round_up).float().contiguous(),
                          (l1 * round_up).float().contiguous(), weight.detach().contiguous())


class Int16ScreenedLmHead(PackedArgmaxLmHead):
    name = "float32 with int16 greedy screen"

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor, screen: Int16Screen):
        """`weight` float32 [vocab, hidden], its packing (`pack_weight`) and `build_int16_screen(weight)`."""
        super().__init__(weight, packed)
        self.screen = screen

    @torch.no_grad()
    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.screen.argmax(hidden, self.packed)
