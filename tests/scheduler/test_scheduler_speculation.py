"""The scheduler's side of speculative decoding, driven by the fake worker (which checks
every KV slot a step reads): drafts in the token budget, rollback of rejected drafts'
slots, prefix caching of accepted tokens only, preemption, and the batch-size switch."""
from __future__ import annotations

import random

from common.structured_outputs import StructuredOutputs
from fake_worker import (assert_no_leaked_blocks, deterministic_sample, make_request, make_scheduler,
                         run_to_completion, step)
from scheduler.kv_cache_manager import cdiv

VOCAB = 1000
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def noisy_proposer(truth, wrong_rate: float, k: int = 3, seed: int = 0):
    """Drafts that continue the 'model' (truth), each one replaced by a wrong token with
    probability `wrong_rate`: some steps accept all, some a prefix, some none."""
    rng = random.Random(seed)

    def propose(request_id: str, token_ids: list[int]) -> list[int]:
        drafts, tokens = [], list(token_ids)
        for _ in range(rng.randint(0, k)):
            token = truth(request_id, tokens)
            if rng.random() < wrong_rate:
                token = (token + 1 + rng.randrange(VOCAB - 1)) % VOCAB
            drafts.append(token)
            tokens.append(token)
        return drafts
    return propose


def run(prompts: dict[str, list[int]], *, speculative: dict | None, propose=None, max_tokens: int = 20,
        **settings):
    truth = deterministic_sample(VOCAB)
    scheduler, worker = make_scheduler(sample_fn=truth, propose_fn=propose, speculative_config=speculative,
                                       **settings)
    for request_id, prompt in prompts.items():
        scheduler.add_request(make_request(request_id, prompt, max_tokens=max_tokens, ignore_eos=True))
    result = run_to_completion(scheduler, worker)
    return scheduler, result


def prompts(count: int, length: int = 9, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(3, VOCAB) for _ in range(length)] for i in range(count)}


def test_outputs_equal_plain_decoding_and_drafts_are_checked():
    truth = deterministic_sample(VOCAB)
    settings = dict(num_blocks=64, max_model_len=64)
    _, plain = run(prompts(4), speculative=None, **settings)
    scheduler, spec = run(prompts(4), speculative=NGRAM, propose=noisy_proposer(truth, 0.3), **settings)
    assert spec.tokens == plain.tokens
    stats = scheduler.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[1] >= stats.accepted_per_position[2]
    # Fewer steps than one token each: accepted drafts are tokens gained.
    assert len(spec.plans) < len(plain.plans)
    assert_no_leaked_blocks(scheduler)


def test_heavy_rejection_gives_back_every_rejected_slot():
    truth = deterministic_sample(VOCAB)
    scheduler, worker = make_scheduler(num_blocks=40, max_model_len=64, sample_fn=truth,
                                       propose_fn=noisy_proposer(truth, 1.0, k=3), speculative_config=NGRAM)
    for request_id, prompt in prompts(4).items():
        scheduler.add_request(make_request(request_id, prompt, max_tokens=24, ignore_eos=True))
    kv = scheduler.kv_cache_manager
    while scheduler.has_unfinished_requests():
        step(scheduler, worker)
        for request in scheduler.running:  # after update: no block past the next token's slot
            assert len(kv.req_to_blocks[request.request_id]) <= cdiv(request.num_computed_tokens + 1, 4)
    assert scheduler.spec_stats.num_draft_tokens > 0 and scheduler.spec_stats.num_accepted_tokens == 0
    assert_no_leaked_blocks(scheduler)


def test_drafts_count_in_the_token_budget_and_stop_at_max_tokens():
    truth = deterministic_sample(VOCAB)
    scheduler, result = run(prompts(3), speculative={"method": "ngram", "num_speculative_tokens": 5},
                            propose=noisy_proposer(truth, 0.0, k=5), max_tokens=7, num_blocks=40,
                            max_model_len=64, max_num_batched_tokens=8)
    for plan in result.plans:
        assert sum(plan.num_scheduled_tokens.values()) <= 8
        for request_id, drafts in plan.draft_token_ids.items():
            assert plan.num_scheduled_tokens[request_id] == 1 + len(drafts)
    assert all(len(tokens) == 7 for tokens in result.tokens.values())
    assert scheduler.spec_stats.num_accepted_tokens > 0
    assert_no_leaked_blocks(scheduler)


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    truth = deterministic_sample(VOCAB)
    prompt = [5, 6, 7, 8]
    plain_tokens = []
    tokens = list(prompt)
    for _ in range(12):
        plain_tokens.append(truth("r", tokens))
        tokens.append(plain_tokens[-1])
    stop = plain_tokens[5]  # a stop token the drafts will carry (accepted, not the last of its step)
    scheduler, worker = make_scheduler(num_blocks=40, max_model_len=64, sample_fn=truth,
                                       propose_fn=noisy_proposer(truth, 0.0, k=4), speculative_config={
                                           "method": "ngram", "num_speculative_tokens": 4})
    scheduler.add_request(make_request("r", prompt, max_tokens=12, stop_token_ids=[stop]))
    result = run_to_completion(scheduler, worker)
    assert result.tokens["r"] == plain_tokens[:plain_tokens.index(stop) + 1]
    assert_no_leaked_blocks(scheduler)


def test_prefix_cache_holds_only_accepted_tokens():
    """A later request whose prompt is an earlier one's prompt and output hits its blocks; the
    fake worker checks every position it reads back, so a block cached with a rejected draft's
    KV would fail here."""
    truth = deterministic_sample(VOCAB)
    scheduler, worker = make_scheduler(num_blocks=64, max_model_len=64, sample_fn=truth,
                                       propose_fn=noisy_proposer(truth, 0.5, seed=3), speculative_config=NGRAM)
    prompt = list(range(10, 19))
    scheduler.add_request(make_request("first", prompt, max_tokens=21, ignore_eos=True))
    first = run_to_completion(scheduler, worker)
    scheduler.add_request(make_request("second", prompt + first.tokens["first"], max_tokens=4, ignore_eos=True))
    hits_before = scheduler.kv_cache_manager.prefix_cache_hits
    second = run_to_completion(scheduler, worker)
    assert scheduler.kv_cache_manager.prefix_cache_hits - hits_before >= 24
    tokens = prompt + first.tokens["first"]
    for _ in range(4):
        tokens.append(truth("second", tokens))
    assert second.tokens["second"] == tokens[-4:]
    assert_no_leaked_blocks(scheduler)


def test_preemption_under_speculation():
    truth = deterministic_sample(VOCAB)
    settings = dict(num_blocks=14, max_model_len=40, max_tokens=24)
    _, plain = run(prompts(4), speculative=None, **settings)
    scheduler, spec = run(prompts(4), speculative=NGRAM, propose=noisy_proposer(truth, 0.3), **settings)
    assert scheduler.num_preemptions > 0 and scheduler.spec_stats.num_drafts > 0
    assert spec.tokens == plain.tokens
    assert_no_leaked_blocks(scheduler)


def test_no_drafts_at_or_above_disable_by_batch_size():
    truth = deterministic_sample(VOCAB)
    config = {**NGRAM, "disable_by_batch_size": 3}
    scheduler, worker = make_scheduler(num_blocks=64, max_model_len=64, sample_fn=truth,
                                       propose_fn=noisy_proposer(truth, 0.0), speculative_config=config)
    for request_id, prompt in prompts(4).items():
        scheduler.add_request(make_request(request_id, prompt, max_tokens=12 if request_id in ("r0", "r1") else 30,
                                           ignore_eos=True))
    checked_while_full = checked_later = 0
    while scheduler.has_unfinished_requests():
        running = len(scheduler.running)
        plan = scheduler.schedule()
        if plan is None:
            continue
        assert plan.speculate == (running < 3)
        if running >= 3:
            checked_while_full += len(plan.draft_token_ids)
        else:
            checked_later += len(plan.draft_token_ids)
        scheduler.update(plan, worker.execute(plan))
    assert checked_while_full == 0 and checked_later > 0
    assert_no_leaked_blocks(scheduler)


def test_structured_output_requests_run_without_drafts():
    truth = deterministic_sample(VOCAB)
    scheduler, worker = make_scheduler(num_blocks=64, max_model_len=64, sample_fn=truth,
                                       propose_fn=noisy_proposer(truth, 0.0), speculative_config=NGRAM)
    scheduler.add_request(make_request("json", list(range(3, 12)), max_tokens=10, ignore_eos=True,
                                       structured_outputs=StructuredOutputs(json_object=True)))
    scheduler.add_request(make_request("plain", list(range(3, 12)), max_tokens=10, ignore_eos=True))
    result = run_to_completion(scheduler, worker)
    assert all("json" not in plan.draft_token_ids for plan in result.plans)
    assert any("plain" in plan.draft_token_ids for plan in result.plans)
