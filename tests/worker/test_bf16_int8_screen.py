"""The int8 screen of the bfloat16 greedy lm_head picks exactly the token the plain path picks
(the argmax of the bf16 packed logits; with the near-tie re-score on, the near-top scan and float32
settling of near ties): at model and odd sizes,
on planted exact and near ties, with outlier channels calibrated or not, through its fallbacks,
and inside the engine. Its bounds hold column by column, also where the int8 rounding errors add
up to what each term of the bound allows."""
from __future__ import annotations

import random

import pytest
import torch

from worker.kernels import cpu_extension, cpu_ops
from worker.lm_head.bf16_int8_screen import (OUTLIER_CHANNELS, Bf16Int8ScreenedLmHead, build_bf16_screen,
                                             outlier_channels)
from worker.lm_head.near_tie_rescore import NearTieRescore, NearTopScan, near_top_scan, refine_greedy
from pagedserve.offline.llm import LLM
from worker.models import packed_linear
from pagedserve.bench.throughput import greedy_params
from tests.tiny_models import build_tiny_hf_model

module = cpu_ops.load()
# A failed build is no reason to skip (test_cpu_kernel_build fails instead): only no compiler or another CPU.
needs_screen = pytest.mark.skipif(not cpu_extension.expected() or (module is not None and not module.bf16_screen_available()),
                                  reason="needs the C++ kernel on a CPU with AVX512-BF16 and AVX512-VNNI")
BF16 = torch.finfo(torch.bfloat16)


def plain(weight: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain path: (its greedy tokens, the near-top scan's argmax and counts)."""
    logits = packed_linear.linear(x, weight, None, packed_linear.pack_weight(weight))
    argmax, counts = near_top_scan(logits, torch.bfloat16)
    return refine_greedy(logits, torch.arange(x.shape[0]), x, weight, torch.bfloat16), argmax, counts


def screened(weight: torch.Tensor, x: torch.Tensor, calibration: torch.Tensor, rescore: bool = True) -> tuple:
    """(the screened head's greedy tokens, with the near-tie re-score on or off; the kernel's raw result)."""
    packed = packed_linear.pack_weight(weight)
    near_ties = NearTieRescore(weight, NearTopScan(compile=False)) if rescore else None
    head = Bf16Int8ScreenedLmHead(weight, packed, near_ties)
    assert head.wants_calibration() and head.greedy(x) is None  # plain until calibrated
    assert head.calibrate(calibration) and not head.wants_calibration()
    screen = head.screen
    raw = module.screened_bf16_argmax(x, weight, packed, screen.packed, screen.outlier_packed, screen.rest,
                                      screen.outliers, screen.column_terms, screen.offset_share, weight.shape[0],
                                      float(BF16.eps), float(BF16.tiny))
    return head.greedy(x), raw


def planted_problem(out_features: int, in_features: int, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) * 0.05
    x = torch.randn(rows, in_features, generator=g)
    x[:, 3] *= 40  # outlier channels, as final hidden states have
    x[:, in_features - 2] *= -25
    weight[7] = weight[5]  # an exact tie (the first column wins) ...
    weight[9] = weight[5] * (1 + 2**-9)  # ... and near ties, closer than bf16 can tell apart
    weight[out_features - 1] = weight[5] * (1 - 2**-10)
    x[0] = weight[5] * 100  # a row whose top is the planted group
    return weight.bfloat16(), x.bfloat16()


@needs_screen
@pytest.mark.parametrize("out_features, in_features, rows", [(49152, 576, 64), (1000, 38, 5), (333, 64, 300),
                                                             (4099, 2048, 9)])
def test_screened_greedy_is_the_plain_greedy(out_features, in_features, rows):
    weight, x = planted_problem(out_features, in_features, rows, seed=out_features)
    _, calibration = planted_problem(out_features, in_features, 16, seed=out_features + 1)
    expected, argmax, counts = plain(weight, x)
    tokens, (chosen, near, candidate_rows, candidate_tokens) = screened(weight, x, calibration)
    assert tokens.tolist() == expected.tolist()
    assert chosen.tolist() == argmax.tolist() and near.tolist() == counts.tolist()
    tokens_without_rescore, _ = screened(weight, x, calibration, rescore=False)
    assert tokens_without_rescore.tolist() == argmax.tolist()  # the re-score off: the bf16 argmax
    assert counts[0] >= 3  # the planted group is a near tie: settled in float32
    assert candidate_rows.tolist() == sorted(candidate_rows.tolist())
    assert len(candidate_tokens) == int(counts[counts > 1].sum())


@needs_screen
def test_uncalibrated_channels_and_rows_without_a_positive_bound_stay_exact():
    weight, x = planted_problem(700, 96, 40, seed=3)
    x[1] = 0.0  # every logit 0: all tie, the first wins (no positive lower bound: every column exact)
    x[2] = (-x[0].float()).bfloat16()  # the planted group at the bottom, the rest near zero
    wrong_calibration = torch.zeros(4, 96)
    wrong_calibration[:, 50:50 + OUTLIER_CHANNELS] = 1.0  # not where the outliers are: loose bounds
    expected, _, _ = plain(weight, x)
    tokens, _ = screened(weight, x, wrong_calibration.bfloat16())
    assert tokens.tolist() == expected.tolist() and tokens[1] == 0


@needs_screen
def test_rows_that_are_not_finite_send_the_call_back_to_the_plain_path():
    weight, x = planted_problem(300, 64, 4, seed=5)
    x[2, 7] = float("nan")
    tokens, raw = screened(weight, x, x[:1])
    assert tokens is None and raw == []


@needs_screen
def test_screen_only_for_bfloat16_weights_it_can_bound():
    outliers = torch.arange(OUTLIER_CHANNELS)
    assert build_bf16_screen(torch.randn(64, 96), outliers) is None  # float32: the int16 screen's
    assert build_bf16_screen(torch.randn(64, 95).bfloat16(), outliers) is None  # odd K: no pairs
    assert build_bf16_screen(torch.randn(64, OUTLIER_CHANNELS).bfloat16(), outliers) is None  # no rest
    weight = torch.randn(64, 96).bfloat16()
    weight[3, 4] = float("inf")
    assert build_bf16_screen(weight, outliers) is None


@needs_screen
@pytest.mark.parametrize("rescore", [False, True], ids=["argmax", "rescore"])
def test_engine_arms_the_screen_at_start_up_and_keeps_its_tokens(tmp_path, rescore):
    """A bf16 engine calibrates the screen while warming up; its greedy tokens (decodes, chunked
    prefills, batches of every size) are those of the same engine with the screen taken away,
    with the near-tie re-score off (the default) and on."""
    directory = tmp_path / "tiny"
    build_tiny_hf_model("LlamaForCausalLM", directory)
    llm = LLM(model=str(directory), dtype="bfloat16", block_size=4, num_gpu_blocks_override=512,
              skip_tokenizer_init=True, max_num_batched_tokens=48, greedy_rescore_near_ties=rescore)
    head = llm.worker.lm_head
    assert isinstance(head, Bf16Int8ScreenedLmHead) and head.rescores_near_ties == rescore
    assert head.screen is not None and not head.wants_calibration()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randint(1, 40))]} for _ in range(12)]
    with_screen = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, greedy_params(20), use_tqdm=False)]
    screen, head.screen = head.screen, None
    without = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, greedy_params(20), use_tqdm=False)]
    assert with_screen == without and sum(map(len, with_screen)) == 240
    assert screen.outliers.numel() == OUTLIER_CHANNELS


def approximations_and_bounds(weight: torch.Tensor, x: torch.Tensor, calibration: torch.Tensor) -> torch.Tensor:
    """[rows, columns, 2]: the screen's approximate logit of every column and its bound."""
    screen = build_bf16_screen(weight, outlier_channels(calibration))
    return module.bf16_screen_bounds(x, weight, packed_linear.pack_weight(weight), screen.packed,
                                     screen.outlier_packed, screen.rest, screen.outliers, screen.column_terms,
                                     screen.offset_share, weight.shape[0])


@needs_screen
def test_every_bound_holds_against_the_kernel_and_the_exact_product():
    weight, x = planted_problem(4099, 576, 40, seed=11)
    _, calibration = planted_problem(4099, 576, 16, seed=12)
    result = approximations_and_bounds(weight, x, calibration)
    approx, bound = result[..., 0].double(), result[..., 1].double()
    exact = x.double() @ weight.double().T
    kernel = packed_linear.linear(x, weight, None, packed_linear.pack_weight(weight)).double()
    assert (approx - exact).abs().le(bound).all()
    # The kernel's float32 value is within the bound; its bf16 logit, rounded from it, within a rounding step more.
    assert (approx - kernel).abs().le(bound + kernel.abs() * 2**-8).all()


OUTLIERS = torch.arange(0, 64, 2)  # 32 channels held in bfloat16; the other 544 of 576 go through int8


def adversarial_problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows and two columns whose int8 error reaches the bound's terms: row 0 sits at half
    levels of its int8 step (every channel's rounding error is half a step) against column 0,
    whose weights are whole levels with the signs that add those errors up; row 1 at whole
    levels against column 1 at half levels, likewise. Columns 2.. are random."""
    k, step_x, step_w = 576, 2.0**-4, 2.0**-10
    rest = torch.tensor([c for c in range(k) if c not in set(OUTLIERS.tolist())])
    g = torch.Generator().manual_seed(21)
    x = torch.randn(2, k, generator=g) * 3
    weight = torch.randn(16, k, generator=g) * 0.05
    half_levels = torch.randint(-100, 100, (rest.numel(),), generator=g).double() + 0.5
    x[0, rest] = (half_levels * step_x).float()
    x[0, rest[0]] = 127 * step_x  # the row's largest rest value: its step is exactly step_x
    x_error = x[0, rest].double() - step_x * torch.round(x[0, rest].double() / step_x)  # half to even, as the C++
    weight[0, rest] = (-torch.sign(x_error) * 127 * step_w).float()  # whole levels: no weight error
    w_half = torch.randint(-100, 100, (rest.numel(),), generator=g).double() + 0.5
    weight[1, rest] = (w_half * step_w).float()
    weight[1, rest[0]] = 127 * step_w
    w_error = weight[1, rest].double() - step_w * torch.round(weight[1, rest].double() / step_w)
    x[1, rest] = (-torch.sign(w_error) * 100 * step_x).float()
    x[1, rest[0]] = 127 * step_x
    for levels in (x[:, rest], weight[:2, rest]):  # bf16 values: nothing rounds on the way in
        assert torch.equal(levels.bfloat16().float(), levels)
    calibration = torch.zeros(1, k)
    calibration[0, OUTLIERS] = 100.0
    return weight.bfloat16(), x.bfloat16(), calibration.bfloat16()


@needs_screen
def test_bounds_hold_where_the_int8_error_is_as_large_as_they_allow():
    """Each of the bound's rounding terms is reached within 2 % (so a bound that left one out, or
    a quantization that rounded worse than it claims, fails here)."""
    weight, x, calibration = adversarial_problem()
    assert torch.equal(outlier_channels(calibration), OUTLIERS)
    result = approximations_and_bounds(weight, x, calibration)
    approx, bound = result[..., 0].double(), result[..., 1].double()
    error = (approx - x.double() @ weight.double().T).abs()
    assert error.le(bound).all()
    assert error[0, 0] > 0.98 * bound[0, 0] and error[1, 1] > 0.98 * bound[1, 1]
