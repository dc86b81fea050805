"""InputBatch: request state diffs and the exact flattened batch for hand-built plans."""
from __future__ import annotations

import random

import pytest

from common.protocol import CachedRequestData, NewRequestData, StepPlan
from common.sampling_params import SamplingParams
from worker.input_batch import InputBatch
from worker.sampler import step_seed

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0)


def new(request_id: str, token_ids: list[int], block_ids: list[int], num_computed: int = 0,
        num_prompt: int | None = None, params: SamplingParams = GREEDY) -> NewRequestData:
    return NewRequestData(request_id=request_id, token_ids=token_ids,
                          num_prompt_tokens=len(token_ids) if num_prompt is None else num_prompt,
                          sampling_params=params, block_ids=block_ids, num_computed_tokens=num_computed)


def cached(request_id: str, new_block_ids: list[int], num_computed: int) -> CachedRequestData:
    return CachedRequestData(request_id=request_id, new_block_ids=new_block_ids, num_computed_tokens=num_computed)


def step(batch: InputBatch, plan: StepPlan):
    batch.apply_plan(plan)
    return batch.build(plan.num_scheduled_tokens)


def test_mixed_decode_chunked_prefill_and_prefix_hit():
    batch = InputBatch(BLOCK)
    plan = StepPlan(step_id=0, new_requests=[
        new("a", [10, 11, 12, 13, 14, 15], [3, 7]),  # 6-token prompt, first chunk of 4
        new("b", list(range(20, 29)), [5, 6, 9], num_computed=8),  # prefix hit: only the last token
        new("c", [30, 31, 32], [2]),  # whole prompt
    ], num_scheduled_tokens={"a": 4, "b": 1, "c": 3})
    out = step(batch, plan)

    # b has one query token, so it goes first as a decode.
    assert out.input_ids.tolist() == [28, 10, 11, 12, 13, 30, 31, 32]
    assert out.positions.tolist() == [8, 0, 1, 2, 3, 0, 1, 2]
    assert out.attn_metadata.slot_mapping.tolist() == [9 * 4 + 0, 12, 13, 14, 15, 8, 9, 10]
    meta = out.attn_metadata
    assert meta.num_decodes == 1
    assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu == [0, 1, 5, 8]
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu == [9, 4, 3]
    assert meta.block_tables.tolist() == [[5, 6, 9], [3, 0, 0], [2, 0, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (4, 9)
    assert str(meta.slot_mapping.dtype) == "torch.int64"
    assert str(meta.query_start_loc.dtype) == str(meta.seq_lens.dtype) == str(meta.block_tables.dtype) == "torch.int32"
    # a's chunk stops short of its prompt end: it does not sample.
    assert out.logits_indices.tolist() == [0, 7]
    assert out.sampling_request_ids == ["b", "c"]
    assert out.sampling_metadata.all_greedy and out.sampling_metadata.num_rows == 2

    out.commit([100, 200])
    assert batch.requests["b"].token_ids[-1] == 100 and batch.requests["b"].num_computed_tokens == 9
    assert batch.requests["c"].token_ids == [30, 31, 32, 200]
    assert batch.requests["a"].token_ids == [10, 11, 12, 13, 14, 15]
    assert batch.requests["a"].num_computed_tokens == 4

    # Step 2: b finished; a finishes its prompt (and gets a block it does not
    # need yet), c decodes its sampled token without the scheduler resending it.
    plan = StepPlan(step_id=1, finished_request_ids=["b"],
                    cached_requests=[cached("a", [8], 4), cached("c", [], 3)],
                    num_scheduled_tokens={"a": 2, "c": 1})
    out = step(batch, plan)
    assert "b" not in batch.requests
    assert batch.requests["a"].block_ids == [3, 7, 8]
    assert out.input_ids.tolist() == [200, 14, 15]
    assert out.positions.tolist() == [3, 4, 5]
    assert out.attn_metadata.slot_mapping.tolist() == [2 * 4 + 3, 7 * 4 + 0, 7 * 4 + 1]
    assert out.attn_metadata.block_tables.tolist() == [[2, 0], [3, 7]]
    assert out.attn_metadata.seq_lens_cpu == [4, 6]
    assert out.logits_indices.tolist() == [0, 2]
    assert out.sampling_request_ids == ["c", "a"]
    out.commit([201, 101])

    # Step 3: both decode; c crosses into a new block.
    plan = StepPlan(step_id=2, cached_requests=[cached("a", [], 6), cached("c", [11], 4)],
                    num_scheduled_tokens={"a": 1, "c": 1})
    out = step(batch, plan)
    assert out.input_ids.tolist() == [101, 201]
    assert out.positions.tolist() == [6, 4]
    assert out.attn_metadata.slot_mapping.tolist() == [7 * 4 + 2, 11 * 4 + 0]
    assert out.attn_metadata.num_decodes == 2
    assert out.logits_indices.tolist() == [0, 1]


def test_readmission_replaces_state():
    batch = InputBatch(BLOCK)
    first = step(batch, StepPlan(step_id=0, new_requests=[new("a", [1, 2, 3], [4])],
                                 num_scheduled_tokens={"a": 3}))
    first.commit([9])
    # Preempted: listed as finished and re-sent, with its generated token, in the same plan.
    plan = StepPlan(step_id=1, finished_request_ids=["a"],
                    new_requests=[new("a", [1, 2, 3, 9], [6], num_prompt=3)],
                    num_scheduled_tokens={"a": 4})
    out = step(batch, plan)
    state = batch.requests["a"]
    assert state.block_ids == [6] and state.num_computed_tokens == 0 and state.num_output_tokens == 1
    assert out.input_ids.tolist() == [1, 2, 3, 9]
    assert out.attn_metadata.slot_mapping.tolist() == [24, 25, 26, 27]
    assert out.logits_indices.tolist() == [3]

    # A NewRequestData for a held id replaces it even without a finished entry.
    out = step(batch, StepPlan(step_id=2, new_requests=[new("a", [5, 6], [2], num_computed=1)],
                               num_scheduled_tokens={"a": 1}))
    assert batch.requests["a"].token_ids == [5, 6]
    assert out.input_ids.tolist() == [6] and out.attn_metadata.slot_mapping.tolist() == [9]


def test_finished_only_plan_updates_state_and_builds_nothing():
    batch = InputBatch(BLOCK)
    batch.apply_plan(StepPlan(step_id=0, new_requests=[new("a", [1], [1]), new("b", [2], [2])]))
    plan = StepPlan(step_id=1, finished_request_ids=["a", "never-seen"])
    assert step(batch, plan) is None
    assert list(batch.requests) == ["b"]


def test_seeded_sampling_rows_carry_output_counts():
    batch = InputBatch(BLOCK)
    params = SamplingParams(temperature=1.0, seed=7)
    out = step(batch, StepPlan(step_id=0, new_requests=[
        new("g", [1, 2], [1]), new("s", [3, 4, 5, 6], [2, 3], num_prompt=2, params=params)],
        num_scheduled_tokens={"g": 2, "s": 4}))
    meta = out.sampling_metadata
    assert meta.random_rows.tolist() == [1]
    assert meta.seeds == {0: step_seed(7, 2)}


def test_invalid_plans_rejected():
    batch = InputBatch(BLOCK)
    batch.apply_plan(StepPlan(step_id=0, new_requests=[new("a", [1, 2, 3, 4, 5], [1])]))
    with pytest.raises(KeyError):
        batch.build({"zzz": 1})
    with pytest.raises(ValueError, match="only 5 known"):
        batch.build({"a": 6})
    with pytest.raises(ValueError, match="needs 2 blocks"):
        batch.build({"a": 5})
    with pytest.raises(KeyError):
        batch.apply_plan(StepPlan(step_id=1, cached_requests=[cached("zzz", [], 0)]))


def test_random_plans_match_per_token_reference():
    """Vectorized arrays equal a straightforward per-token computation."""
    rng = random.Random(0)
    batch = InputBatch(BLOCK)
    news, scheduled, next_block = [], {}, 1
    for i in range(12):
        length = rng.randint(1, 40)
        num_blocks = -(-length // BLOCK) + rng.randint(0, 2)
        blocks = list(range(next_block, next_block + num_blocks))
        rng.shuffle(blocks)
        next_block += num_blocks
        computed = rng.randint(0, length - 1)
        news.append(new(f"r{i}", [rng.randrange(1000) for _ in range(length)], blocks, num_computed=computed))
        scheduled[f"r{i}"] = rng.randint(1, length - computed)
    out = step(batch, StepPlan(step_id=0, new_requests=news, num_scheduled_tokens=scheduled))

    order = [r for r, n in scheduled.items() if n == 1] + [r for r, n in scheduled.items() if n != 1]
    ids, positions, slots, logits_indices = [], [], [], []
    for request_id in order:
        state, n = batch.requests[request_id], scheduled[request_id]
        for pos in range(state.num_computed_tokens, state.num_computed_tokens + n):
            ids.append(state.token_ids[pos])
            positions.append(pos)
            slots.append(state.block_ids[pos // BLOCK] * BLOCK + pos % BLOCK)
        if state.num_computed_tokens + n == state.num_tokens:
            logits_indices.append(len(ids) - 1)
    assert out.input_ids.tolist() == ids
    assert out.positions.tolist() == positions
    assert out.attn_metadata.slot_mapping.tolist() == slots
    assert out.logits_indices.tolist() == logits_indices
    assert out.attn_metadata.num_decodes == sum(1 for n in scheduled.values() if n == 1)
