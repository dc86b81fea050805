"""Worker end to end on a tiny random Llama: hand-written step plans (chunked
prefill, decodes, preemption) must reproduce transformers' greedy generate."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from common.config import EngineConfig
from common.protocol import CachedRequestData, EngineRequest, NewRequestData, StepPlan
from common.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from worker.worker import Worker

BLOCK = 4
NUM_BLOCKS = 40
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = {"a": [5, 77, 130, 9, 250, 31, 64, 2, 199, 18, 47, 101, 3], "b": [12, 240, 8, 91, 150, 33, 7]}
NUM_NEW = 8


def hf_greedy(hf_model, prompt: list[int], num_new: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=num_new, min_new_tokens=num_new, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_worker(model_dir: Path, **overrides) -> Worker:
    settings = dict(model=str(model_dir), dtype="float32", device="cpu", attention_backend="torch",
                    block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS, seed=0)
    return Worker(EngineConfig(**{**settings, **overrides}))


class HandScheduler:
    """Just enough bookkeeping to write plans by hand: hands out fresh block ids
    as requests grow, tracks what the worker already holds."""

    def __init__(self):
        self.next_block = 1
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.step_id = 0

    def _grow(self, request_id: str, upto: int) -> list[int]:
        held = self.blocks.setdefault(request_id, [])
        fresh = []
        while len(held) * BLOCK < upto:
            held.append(self.next_block)
            fresh.append(self.next_block)
            self.next_block += 1
        return fresh

    def plan(self, chunks: dict[str, int], admit: tuple[str, ...] = (), finished: tuple[str, ...] = ()) -> StepPlan:
        plan = StepPlan(step_id=self.step_id, finished_request_ids=list(finished))
        self.step_id += 1
        for request_id in finished:
            self.blocks.pop(request_id, None)
        for request_id, n in chunks.items():
            fresh = self._grow(request_id, self.computed[request_id] + n)
            if request_id in admit:
                plan.new_requests.append(NewRequestData(
                    request_id=request_id, token_ids=list(self.tokens[request_id]),
                    num_prompt_tokens=len(PROMPTS[request_id]), sampling_params=GREEDY,
                    block_ids=list(self.blocks[request_id]), num_computed_tokens=self.computed[request_id]))
            else:
                plan.cached_requests.append(CachedRequestData(
                    request_id=request_id, new_block_ids=fresh, num_computed_tokens=self.computed[request_id]))
            plan.num_scheduled_tokens[request_id] = n
            self.computed[request_id] += n
        return plan

    def admit(self, request_id: str, chunk: int, **others: int) -> StepPlan:
        self.tokens[request_id] = list(PROMPTS[request_id])
        self.computed[request_id] = 0
        return self.plan({request_id: chunk, **others}, admit=(request_id,))

    def record(self, result) -> None:
        for request_id, token in zip(result.request_ids, result.sampled_token_ids):
            self.tokens[request_id].append(token)


def test_chunked_prefill_then_decodes_match_transformers(tiny_hf_model):
    hf_model, model_dir = tiny_hf_model("LlamaForCausalLM")
    expected = {r: hf_greedy(hf_model, p, NUM_NEW) for r, p in PROMPTS.items()}
    worker = make_worker(model_dir)
    sched = HandScheduler()

    # Step 0: a's prompt starts (5 of 13 tokens, no sample), b's prompt runs whole.
    sched.tokens["b"], sched.computed["b"] = list(PROMPTS["b"]), 0
    sched.tokens["a"], sched.computed["a"] = list(PROMPTS["a"]), 0
    result = worker.execute(sched.plan({"a": 5, "b": 7}, admit=("a", "b")))
    assert result.step_id == 0 and result.request_ids == ["b"] and result.execute_ns > 0
    sched.record(result)
    # Step 1: b decodes (first in the batch), a continues its prompt.
    result = worker.execute(sched.plan({"a": 5, "b": 1}))
    assert result.request_ids == ["b"]
    sched.record(result)
    # Step 2: a finishes its prompt and samples.
    result = worker.execute(sched.plan({"b": 1, "a": 3}))
    assert result.request_ids == ["b", "a"]
    sched.record(result)
    while any(len(sched.tokens[r]) - len(PROMPTS[r]) < NUM_NEW for r in PROMPTS):
        running = {r: 1 for r in PROMPTS if len(sched.tokens[r]) - len(PROMPTS[r]) < NUM_NEW}
        result = worker.execute(sched.plan(running))
        assert sorted(result.request_ids) == sorted(running)
        sched.record(result)

    for request_id, prompt in PROMPTS.items():
        assert sched.tokens[request_id][len(prompt):] == expected[request_id], request_id

    # A plan that only finishes requests runs nothing and frees their state.
    result = worker.execute(StepPlan(step_id=99, finished_request_ids=["a", "b"]))
    assert (result.step_id, result.request_ids, result.sampled_token_ids) == (99, [], [])
    assert len(worker.input_batch) == 0


def test_preempted_request_resumes_with_same_greedy_tokens(tiny_hf_model):
    hf_model, model_dir = tiny_hf_model("LlamaForCausalLM")
    expected = hf_greedy(hf_model, PROMPTS["a"], NUM_NEW)
    worker = make_worker(model_dir)
    sched = HandScheduler()
    sched.record(worker.execute(sched.admit("a", 13)))
    for _ in range(3):
        sched.record(worker.execute(sched.plan({"a": 1})))
    assert len(sched.tokens["a"]) == 13 + 4
    # Preempt (recompute): the worker forgets it; it comes back with prompt +
    # generated tokens as a new request, recomputed in two chunks.
    sched.computed["a"] = 0
    plan = sched.plan({"a": 10}, admit=("a",), finished=("a",))
    assert plan.finished_request_ids == ["a"] and plan.new_requests[0].token_ids == sched.tokens["a"]
    assert worker.execute(plan).request_ids == []
    sched.record(worker.execute(sched.plan({"a": 7})))
    while len(sched.tokens["a"]) < 13 + NUM_NEW:
        sched.record(worker.execute(sched.plan({"a": 1})))
    assert sched.tokens["a"][13:] == expected


def test_hello_reports_model_and_cache(tiny_hf_model, caplog):
    hf_model, model_dir = tiny_hf_model("LlamaForCausalLM", eos_token_id=[2, 5], max_position_embeddings=64)
    with caplog.at_level("WARNING", logger="worker.worker"):
        worker = make_worker(model_dir, num_gpu_blocks_override=10)
    assert "max_model_len is 37, not the model's 64" in caplog.text  # capped by the cache: said, not silent
    hello = worker.hello()
    assert hello.num_blocks == 10 and hello.block_size == BLOCK
    # Block 0 is reserved; the last token of a max-length sequence is never cached.
    assert hello.max_model_len == 9 * BLOCK + 1
    assert hello.vocab_size == 256 and hello.dtype == "float32"
    assert hello.eos_token_ids == [2, 5]
    assert len(worker.kv_caches) == 2 and worker.kv_caches[0][0].shape == (10, BLOCK, 2, 16)

    caplog.clear()
    worker = make_worker(model_dir, num_gpu_blocks_override=100)
    assert worker.hello().max_model_len == 64  # the model's limit
    assert "max_model_len" not in caplog.text


def test_seeded_sampling_is_reproducible_across_workers(tiny_hf_model):
    _, model_dir = tiny_hf_model("LlamaForCausalLM")
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(other_requests: int) -> list[int]:
        worker = make_worker(model_dir, seed=other_requests)  # the engine seed must not matter
        news = [NewRequestData(request_id=f"x{i}", token_ids=[i + 1, 2, 3], num_prompt_tokens=3,
                               sampling_params=SamplingParams(temperature=1.0), block_ids=[10 + 2 * i, 11 + 2 * i],
                               num_computed_tokens=0) for i in range(other_requests)]
        news.append(NewRequestData(request_id="s", token_ids=PROMPTS["b"], num_prompt_tokens=7,
                                   sampling_params=params, block_ids=[1, 2, 3, 4], num_computed_tokens=0))
        scheduled = {n.request_id: len(n.token_ids) for n in news}
        out = []
        result = worker.execute(StepPlan(step_id=0, new_requests=news, num_scheduled_tokens=scheduled))
        for step in range(1, 6):
            out.append(result.sampled_token_ids[result.request_ids.index("s")])
            cached = [CachedRequestData(request_id=r, new_block_ids=[], num_computed_tokens=n + step - 1)
                      for r, n in scheduled.items()]
            result = worker.execute(StepPlan(step_id=step, cached_requests=cached,
                                             num_scheduled_tokens={r: 1 for r in scheduled}))
        return out

    alone = run(0)
    assert run(3) == alone


def run_with_scheduler(worker: Worker, config: EngineConfig,
                       requests: dict[str, tuple[list[int], SamplingParams]]) -> tuple[dict[str, list[int]], int]:
    """Drive the worker with the real Scheduler; (tokens per request, preemptions)."""
    hello = worker.hello()
    scheduler = Scheduler(config, num_blocks=hello.num_blocks, max_model_len=hello.max_model_len, eos_token_ids=[])
    for request_id, (prompt, params) in requests.items():
        scheduler.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        if plan is not None:
            for out in scheduler.update(plan, worker.execute(plan)):
                tokens[out.request_id] += out.new_token_ids
    return tokens, scheduler.stats().num_preemptions


def test_with_real_scheduler_under_preemption(tiny_hf_model):
    """Small cache and token budget: chunked prefill, prefix hits and preemptions
    all happen, yet greedy output equals transformers and a seeded request
    samples the same tokens as when it runs alone."""
    hf_model, model_dir = tiny_hf_model("LlamaForCausalLM")
    rng = random.Random(0)
    shared_prefix = [rng.randrange(256) for _ in range(9)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    requests = {str(i): (shared_prefix * (i % 2) + [rng.randrange(256) for _ in range(rng.randint(3, 25))], greedy)
                for i in range(8)}
    requests["seeded"] = (PROMPTS["a"], seeded)
    config = EngineConfig(model=str(model_dir), dtype="float32", device="cpu", attention_backend="torch",
                          block_size=BLOCK, num_gpu_blocks_override=30, max_num_batched_tokens=24, max_num_seqs=6)
    worker = Worker(config)
    tokens, preemptions = run_with_scheduler(worker, config, requests)
    assert preemptions > 0
    for request_id, (prompt, params) in requests.items():
        if params is greedy:
            assert tokens[request_id] == hf_greedy(hf_model, prompt, 12), request_id
    alone, _ = run_with_scheduler(make_worker(model_dir, seed=5), config, {"seeded": requests["seeded"]})
    assert len(alone["seeded"]) == 12 and tokens["seeded"] == alone["seeded"]
