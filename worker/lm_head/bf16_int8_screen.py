"""The bfloat16 lm_head whose greedy rows go through an int8 screen
(`screened_bf16_argmax` in `worker/csrc/bf16_screen.h`): the tokens of the
plain bfloat16 lm_head (its argmax; with the near-tie re-score on, as
`worker.lm_head.near_tie_rescore` settles it), without computing most logits
exactly.

W [N, K] is split by input channel. The few channels where the final hidden
states are largest (`OUTLIER_CHANNELS`, picked from a calibration batch at
start-up: `outlier_channels`, `bf16_screen_calibration`) stay bfloat16, packed
for `vdpbf16ps`; the rest are scaled per column into int8 and packed for
`vpdpbusd` ([panels, rest / 4, 16, 4]), with each column's scale, largest
rounding error and l1 norms, which bound the approximate logits. Without the
outlier split those channels, which carry values tens of times a row's median,
would set each row's int8 step and leave most columns to compute again.

Only speed depends on the calibration: the bounds hold for any hidden state.
Until it is calibrated the head runs as the plain one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.kernels import cpu_ops
from worker.lm_head.near_tie_rescore import NearTieRescore
from worker.lm_head.plain_logits import PlainLogitsLmHead
from worker.models.packed_linear import PANEL, panels

OUTLIER_CHANNELS = 32
INT8_LEVELS = 127  # SCREEN_INT8_LEVELS in the C++ source
U8_OFFSET = 128  # SCREEN_U8_OFFSET


@dataclass(frozen=True, slots=True)
class Bf16Int8Screen:
    packed: torch.Tensor  # int8 [panels, rest / 4, 16, 4]: the rest channels, scaled per column
    outlier_packed: torch.Tensor  # bfloat16 [panels, outliers / 2, 16, 2]
    rest: torch.Tensor  # int64 [rest]: x's channel of each packed one (-1: padding)
    outliers: torch.Tensor  # int64 [outliers]
    column_terms: torch.Tensor  # float32 [5, panels x 16]: scale, weight error, l1 rest, l1 outliers, l1
    offset_share: torch.Tensor  # int32 [panels x 16]: 128 x sum q of each column

    def scan(self, hidden: torch.Tensor, bf16_packed: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
        """For the bf16 lm_head `weight` [N, K] (its packing `bf16_packed`): what `near_top_scan` of
        its plain logits gives, [chosen (the argmax), counts, candidate_rows, tokens] (the near-top
        candidates of the rows with counts > 1, row-major); [] for hidden states that are not finite."""
        info = torch.finfo(torch.bfloat16)
        return cpu_ops.load().screened_bf16_argmax(
            hidden, weight, bf16_packed, self.packed, self.outlier_packed, self.rest, self.outliers, self.column_terms,
            self.offset_share, weight.shape[0], float(info.eps), float(info.tiny))


class Bf16Int8ScreenedLmHead(PlainLogitsLmHead):
    name = "bfloat16 with int8 greedy screen"

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor, near_ties: NearTieRescore | None = None):
        """`weight` bfloat16 [vocab, hidden] that `screen_available` accepts, its packing (`pack_weight`)."""
        if not screen_available(weight) or packed is None or packed.dtype != torch.bfloat16:
            raise ValueError("the int8 screen takes a bfloat16 CPU lm_head it can bound, and its bf16 packing")
        super().__init__(weight, packed, near_ties)
        self.screen: Bf16Int8Screen | None = None  # armed by `calibrate`

    def wants_calibration(self) -> bool:
        return self.screen is None

    def calibrate(self, hidden: torch.Tensor) -> bool:
        """Arm the screen with the outlier channels of final hidden states [T, hidden]."""
        if self.screen is None:
            self.screen = build_bf16_screen(self.weight, outlier_channels(hidden))
        return self.screen is not None

    @torch.no_grad()
    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.screen is None:
            return None
        result = self.screen.scan(hidden, self.packed, self.weight)
        if not result:
            return None
        chosen, counts, candidate_rows, tokens = result
        if self.near_ties is None:
            return chosen
        tied = (counts > 1).nonzero().flatten()
        if tied.numel() == 0:
            return chosen
        return self.near_ties.settle(chosen, tied, torch.searchsorted(tied, candidate_rows), tokens, hidden)

    def describe(self) -> str:
        return super().describe() + (", screen calibrated at warm-up" if self.screen is None else "")


def outlier_channels(calibration_hidden: torch.Tensor, count: int = OUTLIER_CHANNELS) -> torch.Tensor:
    """The `count` channels with the largest |value| over calibration hidden states [T, K], ascending."""
    magnitude = calibration_hidden.float().abs().amax(dim=0)
    return magnitude.argsort(descending=True)[:count].sort().values


def screen_available(weight: torch.Tensor) -> bool:
    """Whether the CPU kernel can screen this lm_head: bfloat16, contiguous, even K, more channels
    than outliers, on a CPU with AVX512-BF16 and AVX512-VNNI."""
    module = cpu_ops.load() if weight.device.type == "cpu" else None
    return (module is not None and module.bf16_screen_available() and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.shape[1] > OUTLIER_CHANNELS and weight.shape[1] % 2 == 0
            and weight.is_contiguous())


def build_bf16_screen(weight: torch.Tensor, outliers: torch.Tensor) -> Bf16Int8Screen | None:
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
    return Bf16Int8Screen(
        packed=panels(q.to(torch.int8), 4),
        outlier_packed=panels(weight.detach()[:, outliers], 2),
        rest=_padded(rest, 4), outliers=_padded(outliers, 2),
        column_terms=column_terms.contiguous(), offset_share=offset_share)


def _padded(channels: torch.Tensor, multiple: int) -> torch.Tensor:
    """Channel ids as int64, padded with -1 (a zero channel) to a multiple of `multiple`."""
    pad = -channels.numel() % multiple
    return torch.cat([channels.long(), torch.full((pad,), -1, dtype=torch.long)])
