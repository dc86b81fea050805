"""The lm_head strategy chosen at load, and the float32 re-score of greedy near ties as an option.

Off (the default), a bfloat16 engine's greedy token is the argmax of its bf16 logits, as
vLLM picks it; on (`--greedy-rescore-near-ties`), near ties are settled by float32 dot
products, so greedy picks the argmax of the unrounded logits. Each is checked against its
own reference on a problem whose bf16 logits round near ties together, through every bf16
strategy this CPU can run, and the flag reaches the engine from `LLM(...)`, `pagedserve
worker` and `pagedserve serve`.
"""
from __future__ import annotations

import logging

import pytest
import torch

from common.cli_args import engine_argv, engine_config
from common.config import EngineConfig
from common.sampling_params import SamplingParams
from pagedserve.offline.llm import LLM
from tests.tiny_models import build_tiny_hf_model
from worker.kernels import cpu_ops
from worker.lm_head import LmHead, choose_lm_head
from worker.lm_head.bf16_int8_screen import Bf16Int8ScreenedLmHead
from worker.lm_head.int16_screen import Int16ScreenedLmHead
from worker.lm_head.packed_argmax import PackedArgmaxLmHead
from worker.lm_head.plain_logits import PlainLogitsLmHead
from worker.models.packed_linear import pack_weight
from worker.sampler import Sampler, SamplingMetadata

module = cpu_ops.load()


def near_tie_problem(rows: int = 24, vocab: int = 512, hidden_size: int = 64):
    """bf16 hidden states and lm_head where tokens 3 and 7 top most rows with logits closer
    than bf16 rounding tells apart: hidden @ weight.T differs from float32's argmax there."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, hidden_size, generator=g).bfloat16()
    weight = torch.randn(vocab, hidden_size, generator=g).bfloat16()
    weight[7] = weight[3]
    weight[7, 0] = weight[3, 0] + torch.tensor(2 ** -6).bfloat16()
    weight[3] *= 4
    weight[7] = (weight[7].float() * 4).bfloat16()
    hidden[:, :] = (hidden.float() + weight[3].float() / 8).bfloat16()
    return hidden, weight.contiguous()


def greedy_step(head: LmHead, hidden: torch.Tensor) -> torch.Tensor:
    """An all-greedy step as the runner takes it: the head's greedy path, else logits and the sampler."""
    meta = SamplingMetadata.build([SamplingParams(temperature=0.0)] * hidden.shape[0])
    assert meta.plain_argmax
    tokens = head.greedy(hidden)
    if tokens is not None:
        return tokens
    return Sampler(seed=0).sample(head.logits(hidden, upcast=False), meta, head, hidden).token_ids


def bf16_heads(weight: torch.Tensor, hidden: torch.Tensor, rescore: bool) -> list[LmHead]:
    """The chosen head (calibrated, if it asks) and the plain packed and unpacked heads."""
    chosen = choose_lm_head(weight, rescore_near_ties=rescore)
    if chosen.wants_calibration():
        assert chosen.calibrate(hidden)
    near_ties = getattr(chosen, "near_ties", None)
    heads = [chosen, PlainLogitsLmHead(weight, None, near_ties)]
    if pack_weight(weight) is not None:
        heads.append(PlainLogitsLmHead(weight, pack_weight(weight), near_ties))
    return heads


def test_near_ties_keep_the_bf16_argmax_by_default():
    """Off: every bf16 strategy picks the argmax of its own bf16 logits (the first on ties), the
    vLLM reference, and on this problem that is not the float32 argmax."""
    hidden, weight = near_tie_problem()
    exact = (hidden.float() @ weight.float().T).argmax(dim=-1)
    for head in bf16_heads(weight, hidden, rescore=False):
        assert not head.rescores_near_ties
        reference = head.logits(hidden).argmax(dim=-1)  # float32 copies of bf16 logits: vLLM's sampler
        assert torch.equal(greedy_step(head, hidden), reference), head.describe()
        assert not torch.equal(reference, exact), "the problem must hold near ties that rounding decides"


def test_near_ties_are_rescored_in_float32_when_asked():
    """On: every bf16 strategy picks the argmax of the unrounded (float32) logits."""
    hidden, weight = near_tie_problem()
    exact = (hidden.float() @ weight.float().T).argmax(dim=-1)
    for head in bf16_heads(weight, hidden, rescore=True):
        assert head.rescores_near_ties
        assert torch.equal(greedy_step(head, hidden), exact), head.describe()


def test_the_rescore_leaves_adjusted_and_random_rows_alone():
    """Only greedy rows that nothing adjusts are re-scored; a near-tie row under a logit bias or
    sampled at random keeps what the plain sampler gives it."""
    hidden, weight = near_tie_problem()
    head = choose_lm_head(weight, rescore_near_ties=True)
    exact = (hidden.float() @ weight.float().T).argmax(dim=-1)
    tied = (head.logits(hidden).argmax(dim=-1) != exact).nonzero().flatten()
    assert tied.numel() >= 3, "the problem must hold rows that rounding decides"
    hidden, exact = hidden[tied[:3]], exact[tied[:3]]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias={11: 0.5}),
              SamplingParams(temperature=1.0, seed=3)]
    meta = SamplingMetadata.build(params, [0] * 3, token_ids=[[1, 2]] * 3, num_prompt_tokens=[2] * 3)
    logits = head.logits(hidden)
    rescored = Sampler(seed=0).sample(logits.clone(), meta, head, hidden).token_ids
    plain = Sampler(seed=0).sample(logits.clone(), meta).token_ids
    assert rescored[0] == exact[0] != plain[0]
    assert rescored[1:].tolist() == plain[1:].tolist()
    with pytest.raises(ValueError, match="hidden states"):
        Sampler(seed=0).sample(logits.clone(), meta, head)


def test_float32_heads_pick_the_argmax_and_ignore_the_rescore():
    g = torch.Generator().manual_seed(1)
    weight, hidden = torch.randn(300, 48, generator=g), torch.randn(9, 48, generator=g)
    head = choose_lm_head(weight, rescore_near_ties=True)
    assert not head.rescores_near_ties
    assert torch.equal(greedy_step(head, hidden), head.logits(hidden).argmax(dim=-1))
    assert torch.equal(head.logits(hidden), PlainLogitsLmHead(weight).logits(hidden))


def test_the_strategy_follows_dtype_and_cpu(caplog):
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(200, 64, generator=g)
    with caplog.at_level(logging.INFO, logger="worker.lm_head.strategy_choice"):
        head = choose_lm_head(weight)
    assert f"lm_head: {head.describe()}" in caplog.text
    f32_packed = cpu_ops.packed_linear_available(torch.float32)
    if f32_packed and module.screened_argmax_available():
        assert type(head) is Int16ScreenedLmHead
    elif f32_packed:
        assert type(head) is PackedArgmaxLmHead
    else:
        assert type(head) is PlainLogitsLmHead
    bf16_head = choose_lm_head(weight.bfloat16())
    if module is not None and module.bf16_screen_available():
        assert type(bf16_head) is Bf16Int8ScreenedLmHead and bf16_head.wants_calibration()
    else:
        assert type(bf16_head) is PlainLogitsLmHead
    half = choose_lm_head(weight.half(), rescore_near_ties=True)
    assert type(half) is PlainLogitsLmHead and half.packed is None and half.rescores_near_ties


def test_the_flag_is_off_by_default_and_reaches_every_command():
    from pagedserve.serve import build_parser as serve_parser
    from pagedserve.serve import component_commands
    from worker.worker_cli import build_parser as worker_parser

    assert EngineConfig().greedy_rescore_near_ties is False
    for parser in (worker_parser(), serve_parser()):
        assert engine_config(parser.parse_args([])).greedy_rescore_near_ties is False
        assert engine_config(parser.parse_args(["--greedy-rescore-near-ties"])).greedy_rescore_near_ties is True
    config = EngineConfig(greedy_rescore_near_ties=True)
    assert engine_config(worker_parser().parse_args(engine_argv(config))).greedy_rescore_near_ties
    assert "--greedy-rescore-near-ties" not in engine_argv(EngineConfig())
    commands = component_commands(serve_parser().parse_args(["--greedy-rescore-near-ties"]), "/tmp/x")
    worker = next(c for c in commands if c.argv[0] == "worker")
    assert "--greedy-rescore-near-ties" in worker.argv


@pytest.mark.parametrize("rescore", [False, True])
def test_llm_hands_the_flag_to_its_lm_head(tmp_path, rescore):
    build_tiny_hf_model("LlamaForCausalLM", tmp_path)
    flag = {"greedy_rescore_near_ties": True} if rescore else {}  # off: the default
    llm = LLM(model=str(tmp_path), dtype="bfloat16", block_size=4, num_gpu_blocks_override=64, enforce_eager=True,
              skip_tokenizer_init=True, **flag)
    assert llm.worker.lm_head.rescores_near_ties == rescore
    assert llm.worker.runner.lm_head is llm.worker.lm_head
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
