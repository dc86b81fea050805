"""The int8 screen of a bfloat16 lm_head for greedy steps (`screened_bf16_argmax` in
`worker/csrc/bf16_screen.h`): the same tokens as the plain bfloat16 lm_head
followed by `worker.greedy_refine`, without computing most logits exactly.

W [N, K] is split by input channel. The few channels where the final hidden
states are largest (`OUTLIER_CHANNELS`, picked from a calibration batch at
start-up: `outlier_channels`) stay bfloat16, packed for `vdpbf16ps`; the rest
are scaled per column into int8 and packed for `vpdpbusd` ([panels, rest / 4,
16, 4]), with each column's scale, largest rounding error and l1 norms, which
bound the approximate logits. Simulated on W2's decode rows, this leaves 25 columns of
49,152 on average to compute again exactly (p99 ~250), against ~34,000
without the outlier split: those channels carry values 50-80 times a row's
median, and would set its int8 step.

Only speed depends on the calibration: the bounds hold for any hidden state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.kernels import cpu_ops
from worker.greedy_refine import settle_near_ties
from worker.models.packed_linear import PANEL, panels

OUTLIER_CHANNELS = 32
INT8_LEVELS = 127  # SCREEN_INT8_LEVELS in the C++ source
U8_OFFSET = 128  # SCREEN_U8_OFFSET


@dataclass(frozen=True, slots=True)
class Bf16ScreenedLmHead:
    packed: torch.Tensor  # int8 [panels, rest / 4, 16, 4]: the rest channels, scaled per column
    outlier_packed: torch.Tensor  # bfloat16 [panels, outliers / 2, 16, 2]
    rest: torch.Tensor  # int64 [rest]: x's channel of each packed one (-1: padding)
    outliers: torch.Tensor  # int64 [outliers]
    column_terms: torch.Tensor  # float32 [5, panels x 16]: scale, weight error, l1 rest, l1 outliers, l1
    offset_share: torch.Tensor  # int32 [panels x 16]: 128 x sum q of each column

    def greedy(self, hidden: torch.Tensor, bf16_packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """Each row's greedy token from the bf16 lm_head `weight` [N, K] (its packing `bf16_packed`),
        as `refine_greedy` settles it from the plain logits; None for hidden states that are not finite."""
        info = torch.finfo(torch.bfloat16)
        result = cpu_ops.load().screened_bf16_argmax(
            hidden, weight, bf16_packed, self.packed, self.outlier_packed, self.rest, self.outliers, self.column_terms,
            self.offset_share, weight.shape[0], float(info.eps), float(info.tiny))
        if not result:
            return None
        chosen, counts, candidate_rows, tokens = result
        tied = (counts > 1).nonzero().flatten()
        if tied.numel() == 0:
            return chosen
        return settle_near_ties(chosen, tied, tied, torch.searchsorted(tied, candidate_rows), tokens, hidden, weight)


def outlier_channels(calibration_hidden: torch.Tensor, count: int = OUTLIER_CHANNELS) -> torch.Tensor:
    """The `count` channels with the largest |value| over calibration hidden states [T, K], ascending."""
    magnitude = calibration_hidden.float().abs().amax(dim=0)
    return magnitude.argsort(descending=True)[:count].sort().values


def screen_available(weight: torch.Tensor) -> bool:
    module = cpu_ops.load() if weight.device.type == "cpu" else None
    return (module is not None and module.bf16_screen_available() and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.shape[1] > OUTLIER_CHANNELS and weight.shape[1] % 2 == 0
            and weight.is_contiguous())


def build_bf16_screen(weight: torch.Tensor, outliers: torch.Tensor) -> Bf16ScreenedLmHead | None:
    """The screen of a bf16 CPU lm_head [N, K] with `outliers` (channel ids) kept in bfloat16;
    None where it cannot run."""
    if not screen_available(weight) or not torch.isfinite(weight).all():
        return None
    n, k = weight.shape
    rest_mask = torch.ones(k, dtype=torch.bool)
    rest_mask[outliers] = False
    rest = rest_mask.nonzero().flatten()
    w64 = weight.detach().double()
    rest_w = w64[:, rest]
    scale = (rest_w.abs().amax(dim=1) / INT8_LEVELS).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero column: q = 0, exact
    q = torch.round(rest_w / scale.double()[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS)
    error = (rest_w - scale.double()[:, None] * q).abs().amax(dim=1)
    round_up = 1 + 1e-6
    terms = torch.stack([scale.double(), error * round_up, rest_w.abs().sum(dim=1) * round_up,
                         w64[:, outliers].abs().sum(dim=1) * round_up, w64.abs().sum(dim=1) * round_up]).float()
    width = -(-n // PANEL) * PANEL
    column_terms = torch.zeros(5, width)
    column_terms[:, :n] = terms
    offset_share = torch.zeros(width, dtype=torch.int32)
    offset_share[:n] = (U8_OFFSET * q.sum(dim=1)).to(torch.int32)
    return Bf16ScreenedLmHead(
        packed=panels(q.to(torch.int8), 4),
        outlier_packed=panels(weight.detach()[:, outliers], 2),
        rest=_padded(rest, 4), outliers=_padded(outliers, 2),
        column_terms=column_terms.contiguous(), offset_share=offset_share)


def _padded(channels: torch.Tensor, multiple: int) -> torch.Tensor:
    """Channel ids as int64, padded with -1 (a zero channel) to a multiple of `multiple`."""
    pad = -channels.numel() % multiple
    return torch.cat([channels.long(), torch.full((pad,), -1, dtype=torch.long)])
