"""The named workloads are exactly the issue's, seeded, and files round-trip."""
from __future__ import annotations

import json

import pytest

from pagedserve.bench.workloads import (NAMED_WORKLOADS, BenchRequest, generate_workload, load_workload_file,
                                         resolve_workload, save_workload, workload_summary)


@pytest.mark.parametrize("name,count,lo,hi,out", [("W1", 64, 32, 512, 128), ("W2", 256, 16, 64, 256),
                                                              ("S1", 1, 128, 128, 256)])
def test_named_workloads_match_the_definition(name, count, lo, hi, out):
    requests = resolve_workload(name, vocab_size=49152)
    assert len(requests) == count
    assert all(lo <= len(r.prompt_token_ids) <= hi for r in requests)
    assert all(r.max_tokens == out for r in requests)
    assert all(0 <= t < 49152 for r in requests for t in r.prompt_token_ids)
    lengths = [len(r.prompt_token_ids) for r in requests]
    assert lo == hi or (min(lengths) < lo + (hi - lo) // 4 and max(lengths) > hi - (hi - lo) // 4)  # spread


def test_prefix_workload_shares_long_prefixes():
    requests = resolve_workload("p1", vocab_size=49152)
    assert len(requests) == 128 and resolve_workload("P1", 49152) == requests
    groups: dict[tuple[int, ...], list] = {}
    for r in requests:
        assert 1500 + 32 <= len(r.prompt_token_ids) <= 1500 + 128 and 16 <= r.max_tokens <= 32
        groups.setdefault(tuple(r.prompt_token_ids[:1500]), []).append(r)
    assert sorted(len(g) for g in groups.values()) == [16] * 8
    for group in groups.values():  # the tails are the requests' own: the prefix is exactly 1,500 tokens
        assert len({r.prompt_token_ids[1500] for r in group}) > 1
    assert len({r.max_tokens for r in requests}) > 8
    first_groups = [tuple(r.prompt_token_ids[:1500]) for r in requests[:16]]
    assert len(set(first_groups)) > 1  # interleaved, not one group after another
    assert resolve_workload("P1", 49152, seed=1) != requests


def test_workloads_are_seeded():
    spec = NAMED_WORKLOADS["W1"]
    assert generate_workload(spec, 1000, seed=3) == generate_workload(spec, 1000, seed=3)
    assert generate_workload(spec, 1000, seed=3) != generate_workload(spec, 1000, seed=4)
    assert resolve_workload("w2", 500) == resolve_workload("W2", 500)


def test_file_round_trip_and_summary(tmp_path):
    requests = [BenchRequest([5, 6, 7], 4), BenchRequest([1], 2)]
    path = tmp_path / "w.jsonl"
    save_workload(requests, str(path))
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 4}, {"prompt_token_ids": [1], "max_tokens": 2}]
    assert load_workload_file(str(path)) == requests
    assert resolve_workload(str(path), vocab_size=10) == requests
    assert workload_summary(requests) == {"requests": 2, "prompt_tokens": 4, "output_tokens": 6}


@pytest.mark.parametrize("line", ['{"prompt_token_ids": [], "max_tokens": 3}', '{"prompt_token_ids": [1]}',
                                  '{"prompt_token_ids": [1], "max_tokens": 0}', 'not json'])
def test_bad_files_name_the_line(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_token_ids": [1], "max_tokens": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=":2:"):
        load_workload_file(str(path))


def test_unknown_workload_is_rejected():
    with pytest.raises(ValueError, match="unknown workload"):
        resolve_workload("W9", 100)


def test_c1_is_real_text_to_copy_with_a_change():
    from common.model_files import resolve_model_dir
    from common.tokenizer import load_tokenizer
    from pagedserve.bench.copy_workload import add_typos, copy_tasks

    requests = resolve_workload("c1", vocab_size=49152)
    assert len(requests) == 16 and resolve_workload("C1", 49152) == requests
    tokenizer = load_tokenizer(resolve_model_dir("smollm2-135m-instruct"))
    tasks = copy_tasks()
    for request, (message, answer) in zip(requests, tasks):
        text = tokenizer.decode(request.prompt_token_ids)
        assert message in text and text.startswith("<|im_start|>")  # the chat template around the task
        assert request.max_tokens == len(tokenizer.encode(answer, add_special_tokens=False))
    typo_tasks, code_tasks = tasks[0::2], tasks[1::2]
    for message, answer in typo_tasks:  # the paragraph to fix differs from the answer, but a little
        given = message.split("\n\n", 1)[1]
        assert given != answer and len(given.split()) == len(answer.split())
        assert sum(a != b for a, b in zip(given.split(), answer.split())) <= len(answer.split()) // 4
    for message, answer in code_tasks:
        assert "def " in answer and "_value" in answer and "_value" not in message.split("```python")[1]
    import random
    assert add_typos("word " * 50, random.Random(0)) != "word " * 50
