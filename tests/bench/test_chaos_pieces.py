"""`bench chaos`'s pieces without a server: the specs, the outcome of a reply (streamed
or not) and its comparison, the victim choice and when a victim counts as restarted."""
from __future__ import annotations

import json
import random

import pytest

from pagedserve.bench.chaos import format_report
from pagedserve.bench.chaos_cli import _interval
from pagedserve.bench.chaos_victims import Kill, VictimChooser, kind_of, recovered
from pagedserve.bench.chaos_workload import (Outcome, build_specs, compare, outcome_from_json,
                                             outcome_from_sse)


def test_specs_cover_every_kind_once_per_copy_and_are_fixed_by_the_seed():
    specs = build_specs(seed=3, copies=2)
    assert len(specs) == 32 and len({s.name for s in specs}) == 32
    kinds = {(s.api, s.stream, s.sampling, s.n) for s in specs}
    assert len(kinds) == 16
    assert build_specs(seed=3, copies=2) == specs
    assert build_specs(seed=4, copies=2) != specs
    assert all(16 <= s.max_tokens <= 48 for s in specs)
    assert all((s.seed is None) == (s.sampling == "greedy") for s in specs)


def test_spec_bodies():
    specs = {(s.api, s.stream, s.sampling, s.n): s for s in build_specs(seed=0)}
    chat = specs[("chat", True, "seeded", 2)].body("m")
    assert chat["messages"][0]["role"] == "user" and "prompt" not in chat
    assert (chat["temperature"], chat["top_p"], chat["n"], chat["stream"]) == (0.8, 0.9, 2, True)
    assert isinstance(chat["seed"], int)
    greedy = specs[("completions", False, "greedy", 1)]
    body = greedy.body("m")
    assert body["prompt"] == greedy.prompt and body["temperature"] == 0.0 and "seed" not in body
    assert greedy.path == "/v1/completions" and specs[("chat", False, "greedy", 1)].path == "/v1/chat/completions"


def sse(*events) -> list[str]:
    return [f"data: {json.dumps(e)}" if not isinstance(e, str) else e for e in events] + ["", "data: [DONE]"]


def test_streamed_choices_are_assembled_like_a_plain_reply():
    plain = outcome_from_json({"choices": [{"index": 1, "text": " b c", "finish_reason": "stop"},
                                           {"index": 0, "text": "a b", "finish_reason": "length"}]}, n=2)
    streamed = outcome_from_sse(sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
                                    {"choices": [{"index": 1, "text": " b", "finish_reason": None}]},
                                    {"choices": [{"index": 0, "text": " b", "finish_reason": "length"}]},
                                    {"choices": [{"index": 1, "text": " c", "finish_reason": "stop"}]},
                                    {"choices": [], "usage": {"completion_tokens": 4}}), n=2)
    assert plain.ok and streamed.ok
    assert plain.texts == streamed.texts == ["a b", " b c"]
    assert plain.finish_reasons == streamed.finish_reasons == ["length", "stop"]
    chat = outcome_from_sse(sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                                {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]}), 1)
    assert chat.ok and chat.texts == ["Hi"]
    message = outcome_from_json({"choices": [{"index": 0, "message": {"content": "Hi"}, "finish_reason": "stop"}]}, 1)
    assert message.texts == chat.texts


def test_errors_make_a_failed_outcome():
    assert "service_unavailable" in outcome_from_sse(sse({"error": {"type": "service_unavailable"}}), 1).error
    cut = outcome_from_sse([f"data: {json.dumps({'choices': [{'index': 0, 'text': 'a'}]})}"], 1)
    assert not cut.ok and "[DONE]" in cut.error
    assert "expected 2" in outcome_from_json({"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]},
                                             2).error
    assert not outcome_from_json({"error": {"message": "boom"}}, 1).ok


def test_compare_names_the_first_choice_that_differs():
    spec = build_specs()[0]
    reference = Outcome(["x", "y"], ["length", "stop"])
    assert compare(spec, reference, Outcome(["x", "y"], ["length", "stop"])) is None
    mismatch = compare(spec, reference, Outcome(["x", "z"], ["length", "stop"]))
    assert (mismatch["spec"], mismatch["choice"], mismatch["expected"], mismatch["got"]) == (spec.name, 1, "y", "z")
    assert compare(spec, reference, Outcome(["x", "y"], ["length", "length"]))["choice"] == 1
    assert compare(spec, reference, Outcome(["x"], ["length"]))["got"] is None


def test_kind_of_titles():
    assert kind_of("pagedserve: worker 0") == "worker"
    assert kind_of("pagedserve: scheduler") == "scheduler"
    assert kind_of("pagedserve: tokenizer") == "router"
    assert kind_of("pagedserve: tokenizer 2") == "tokenizer"
    assert kind_of("pagedserve: tokenizer (join)") is None
    assert kind_of("pagedserve: frontend") is None
    assert kind_of("pagedserve: serve") is None
    assert kind_of("python -m something") is None


def test_victims_rotate_over_the_kinds_skipping_absent_ones():
    pids = {"worker": [10], "scheduler": [20], "tokenizer": [31, 32], "router": [30]}
    chooser = VictimChooser(["worker", "tokenizer", "router"], random.Random(0))
    no_children = lambda pid: []  # noqa: E731
    chosen = [chooser.choose(pids, no_children) for _ in range(6)]
    assert [k.kind for k in chosen] == ["worker", "tokenizer", "router"] * 2
    assert {k.pid for k in chosen if k.kind == "tokenizer"} <= {31, 32}
    assert chooser.choose({"scheduler": [20], "router": [30]}, no_children).kind == "router"
    assert VictimChooser(["worker"], random.Random(0)).choose({"scheduler": [20]}, no_children) is None
    with pytest.raises(ValueError):
        VictimChooser(["frontend"], random.Random(0))


def test_a_victim_counts_as_restarted_once_every_kind_is_back_without_what_it_took():
    before = {"worker": [10], "router": [30], "tokenizer": [31, 32]}
    router = Kill("router", 30, before, frozenset([30, 31, 32]))
    assert not recovered(router, {"worker": [10], "tokenizer": [31, 32]})
    assert not recovered(router, {"worker": [10], "router": [40], "tokenizer": [31, 32]})  # old ones dying
    assert not recovered(router, {"worker": [10], "router": [40], "tokenizer": [41]})
    assert recovered(router, {"worker": [10], "router": [40], "tokenizer": [41, 42]})
    worker = Kill("worker", 10, before, frozenset([10]))
    assert not recovered(worker, before)
    assert recovered(worker, {**before, "worker": [11]})


def test_kill_interval_flag():
    assert _interval("20,40") == (20.0, 40.0) == _interval("20-40")
    assert _interval("5") == (5.0, 5.0)
    for bad in ("40,20", "x", "0,1"):
        with pytest.raises(Exception):
            _interval(bad)


def test_report_text():
    report = {"ok": False, "duration_s": 61.2, "settings": {"concurrency": 4, "specs": 16}, "completed": 30,
              "failed": 1, "failures": [{"spec": "chat-plain-greedy-n1-0", "started_s": 3.0, "ended_s": 4.0,
                                         "error": "HTTP 503: gone"}],
              "errors": [{"error": "HTTP 503: gone", "count": 1}],
              "identical": 29, "mismatched": 1,
              "mismatches": [{"spec": "s", "choice": 0, "expected": "a", "got": "b", "started_s": 5.0}],
              "by_sampling": {"greedy": {"completed": 15, "identical": 15}, "seeded": {"completed": 15,
                                                                                       "identical": 14}},
              "kills": [{"kind": "worker", "pid": 7, "t_s": 12.0, "time": "2026-11-29T06:00:00+00:00",
                         "requests_in_flight": 4, "restarted_after_s": 0.4}],
              "kills_per_kind": {"worker": 1},
              "kv_blocks": {"all_free": True, "num_free_blocks": 99, "num_blocks": 100, "usable_blocks": 99,
                            "num_running": 0, "num_waiting": 0}, "problems": []}
    text = format_report(report)
    assert "FAILED" in text and "30 completed, 1 failed" in text and "worker x1" in text
    assert "99 of 99 free" in text and "1x HTTP 503: gone" in text and "expected 'a', got 'b'" in text
