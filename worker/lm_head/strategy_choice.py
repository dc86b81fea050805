"""Which lm_head strategy an engine runs: chosen once, when the model is loaded.

By the lm_head's dtype and device and what the CPU kernel can run:
- float32, packed (AVX-512), AVX512-VNNI: `int16_screen` (greedy through int16 products);
- float32, packed, no VNNI (or a weight the int16 screen cannot bound): `packed_argmax`;
- bfloat16, packed (AVX512-BF16), a weight the int8 screen can bound: `bf16_int8_screen`
  (plain until the start-up calibration arms the screen);
- anything else (no kernel, float16, other devices): `plain_logits`.
Every strategy hands out the same logits and picks the same greedy tokens; with
`rescore_near_ties` a bfloat16 or float16 head re-scores greedy near ties in
float32 (`near_tie_rescore`), which changes some picks, so it is opt-in.
"""
from __future__ import annotations

import logging

import torch

from worker.lm_head.bf16_int8_screen import Bf16Int8ScreenedLmHead, screen_available
from worker.lm_head.int16_screen import Int16ScreenedLmHead, build_int16_screen
from worker.lm_head.interface import LmHead
from worker.lm_head.near_tie_rescore import NearTieRescore, NearTopScan
from worker.lm_head.packed_argmax import PackedArgmaxLmHead
from worker.lm_head.plain_logits import PlainLogitsLmHead
from worker.models.packed_linear import pack_weight

logger = logging.getLogger(__name__)


def reduced_precision(dtype: torch.dtype) -> bool:
    """Whether logits of `dtype` are rounded coarser than float32 (where near ties can be re-scored)."""
    return dtype.is_floating_point and dtype != torch.float32 and dtype != torch.float64


def choose_lm_head(weight: torch.Tensor, *, rescore_near_ties: bool = False, compile_scan: bool = False) -> LmHead:
    """The lm_head strategy for `weight` [vocab, hidden] (the model's lm_head or tied embeddings),
    logged. `rescore_near_ties`: settle greedy near ties of reduced-precision logits in float32
    (ignored for float32); `compile_scan`: compile the near-tie scan where the C++ kernel cannot
    run it (set when the model step itself is compiled)."""
    packed = pack_weight(weight)  # None where the CPU kernel cannot run this weight
    near_ties = None
    if rescore_near_ties and reduced_precision(weight.dtype):
        scan = NearTopScan(compile=compile_scan, use_kernel=weight.device.type == "cpu")
        near_ties = NearTieRescore(weight, scan)
    elif rescore_near_ties:
        logger.info("greedy_rescore_near_ties has no effect on a %s lm_head", weight.dtype)
    head: LmHead
    if packed is not None and packed.dtype == torch.float32:
        screen = build_int16_screen(weight)
        head = PackedArgmaxLmHead(weight, packed) if screen is None else Int16ScreenedLmHead(weight, packed, screen)
    elif packed is not None and packed.dtype == torch.bfloat16 and screen_available(weight):
        head = Bf16Int8ScreenedLmHead(weight, packed, near_ties)
    else:
        head = PlainLogitsLmHead(weight, packed, near_ties)
    logger.info("lm_head: %s", head.describe())
    return head
