"""`bench chaos`'s requests: a fixed set of specs, their HTTP bodies, their outcomes and the comparison.

Every spec is greedy or seeded sampling (temperature 0.8, top_p 0.9, a seed of
its own), so that the same spec always has the same answer: the fault-free run
records it and every answer under faults must equal it. The set covers each
combination of API (completions, chat), streaming (on, off), sampling (greedy,
seeded) and n (1, 2). A streamed answer is assembled per choice (text and
finish reason) and compared exactly like a non-streamed one.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from itertools import product
from typing import Any

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are", "In 1492, Columbus", "Water boils at", "My favourite food is",
           "The quick brown fox", "Explain why the sky is blue.", "Write a haiku about the sea.",
           "List three uses of a paperclip.", "What is the square root of 144?"]
SEEDED_TEMPERATURE = 0.8
SEEDED_TOP_P = 0.9


@dataclass(frozen=True, slots=True)
class RequestSpec:
    name: str  # e.g. "chat-stream-seeded-n2-3"
    api: str  # "completions" or "chat"
    stream: bool
    sampling: str  # "greedy" or "seeded"
    n: int
    prompt: str
    max_tokens: int
    seed: int | None = None  # the request's seed (seeded sampling)
    ignore_eos: bool = False

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "n": self.n, "stream": self.stream,
                                "ignore_eos": self.ignore_eos}
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.sampling == "greedy":
            body["temperature"] = 0.0
        else:
            body.update(temperature=SEEDED_TEMPERATURE, top_p=SEEDED_TOP_P, seed=self.seed)
        return body


def build_specs(seed: int = 0, copies: int = 1, max_tokens: tuple[int, int] = (16, 48)) -> list[RequestSpec]:
    """`copies` specs of each of the 16 kinds (api x stream x sampling x n), prompts, lengths and
    seeds drawn from `seed`: the same arguments give the same set."""
    rng = random.Random(seed)
    specs = []
    for copy in range(copies):
        for api, stream, sampling, n in product(("completions", "chat"), (False, True), ("greedy", "seeded"), (1, 2)):
            specs.append(RequestSpec(
                name=f"{api}-{'stream' if stream else 'plain'}-{sampling}-n{n}-{copy}", api=api, stream=stream,
                sampling=sampling, n=n, prompt=rng.choice(PROMPTS), max_tokens=rng.randint(*max_tokens),
                seed=rng.randrange(1, 2**31) if sampling == "seeded" else None, ignore_eos=rng.random() < 0.5))
    return specs


@dataclass(slots=True)
class Outcome:
    """What one request got: the choices' texts and finish reasons by index, or an error."""
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.finish_reasons) and None not in self.finish_reasons

    def to_json(self) -> dict[str, Any]:
        return {"texts": self.texts, "finish_reasons": self.finish_reasons, "error": self.error}


def _choice_text(choice: dict[str, Any]) -> str:
    """A completion's text, a chat message's content or a streamed delta's content."""
    if "text" in choice:
        return choice["text"] or ""
    return ((choice.get("message") or choice.get("delta") or {}).get("content")) or ""


def _add_choice(outcome: Outcome, choice: dict[str, Any]) -> None:
    index = int(choice.get("index", 0))
    while len(outcome.texts) <= index:
        outcome.texts.append("")
        outcome.finish_reasons.append(None)
    outcome.texts[index] += _choice_text(choice)
    if choice.get("finish_reason"):
        outcome.finish_reasons[index] = choice["finish_reason"]


def outcome_from_json(reply: dict[str, Any], n: int) -> Outcome:
    """The outcome of a non-streamed reply."""
    if "error" in reply:
        return Outcome(error=f"error body: {json.dumps(reply['error'])[:500]}")
    outcome = Outcome()
    for choice in reply.get("choices", []):
        _add_choice(outcome, choice)
    return _check_count(outcome, n)


def outcome_from_sse(lines: list[str], n: int) -> Outcome:
    """The outcome of a streamed reply, from its `data:` lines: the choices assembled by index;
    an error event, or a stream without `[DONE]`, makes it an error."""
    outcome, done = Outcome(), False
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            continue
        event = json.loads(payload)
        if "error" in event:
            outcome.error = f"error event: {json.dumps(event['error'])[:500]}"
            continue
        for choice in event.get("choices", []):
            _add_choice(outcome, choice)
    if outcome.error is None and not done:
        outcome.error = "the stream ended without [DONE]"
    return _check_count(outcome, n)


def _check_count(outcome: Outcome, n: int) -> Outcome:
    if outcome.error is None and (len(outcome.texts) != n or None in outcome.finish_reasons):
        outcome.error = (f"expected {n} finished choices, got {len(outcome.texts)} with finish reasons "
                         f"{outcome.finish_reasons}")
    return outcome


def compare(spec: RequestSpec, reference: Outcome, got: Outcome) -> dict[str, Any] | None:
    """None when `got` equals the fault-free `reference`; else a mismatch record naming the
    first choice that differs, with both texts and finish reasons."""
    if got.texts == reference.texts and got.finish_reasons == reference.finish_reasons:
        return None
    count = max(len(reference.texts), len(got.texts))
    index = next(i for i in range(count) if _choice(reference, i) != _choice(got, i))
    expected, actual = _choice(reference, index), _choice(got, index)
    return {"spec": spec.name, "choice": index, "expected": expected[0], "got": actual[0],
            "expected_finish_reason": expected[1], "got_finish_reason": actual[1]}


def _choice(outcome: Outcome, index: int) -> tuple[str | None, str | None]:
    if index >= len(outcome.texts):
        return None, None
    return outcome.texts[index], outcome.finish_reasons[index]
