"""The worker's compiled grammars are cached, but within a byte budget: a client
that sends a new JSON schema with every request must not grow the worker
without bound (a soak with per-request schemas grew it by ~1.2 MB each)."""
from __future__ import annotations

import gc
import json
import weakref

import pytest
import xgrammar

from common.model_files import resolve_model_dir
from common.structured_outputs import StructuredOutputs
from worker import structured_output
from worker.structured_output import GrammarCompiler

VOCAB_SIZE = 49152  # SmolLM2's
EOS = 2


def schema(i: int) -> StructuredOutputs:
    return StructuredOutputs(json=json.dumps({"type": "object", "properties": {
        f"key{i}": {"type": "string", "maxLength": 12}}, "required": [f"key{i}"]}))


@pytest.fixture
def compiled(monkeypatch) -> tuple[list[weakref.ref], list]:
    """Weak references to every grammar xgrammar compiles, and the compilers that did."""
    refs: list[weakref.ref] = []
    compilers: list = []  # (xgrammar's compilers are not hashable)
    original = xgrammar.GrammarCompiler.compile_grammar

    def recording(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        refs.append(weakref.ref(result))
        if not any(c is self for c in compilers):
            compilers.append(self)
        return result

    monkeypatch.setattr(xgrammar.GrammarCompiler, "compile_grammar", recording)
    return refs, compilers


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    return resolve_model_dir("smollm2-135m-instruct")


def test_distinct_schemas_stay_within_the_cache_budget(tokenizer_dir, compiled, monkeypatch):
    refs, compilers = compiled
    compiler = GrammarCompiler(tokenizer_dir, VOCAB_SIZE, [EOS])
    compiler.matcher(schema(0), "r0")
    budget = 3 * refs[0]().memory_size_bytes + 1  # room for three of them
    monkeypatch.setattr(structured_output, "GRAMMAR_CACHE_BYTES", budget, raising=False)
    for i in range(1, 10):
        compiler.matcher(schema(i), f"r{i}")
    gc.collect()
    alive = [ref() for ref in refs if ref() is not None]
    assert len(refs) == 10
    assert sum(g.memory_size_bytes for g in alive) <= budget
    # xgrammar's own cache (unbounded unless told otherwise) must not keep them either.
    assert all(c.get_cache_size_bytes() <= budget for c in compilers)


def test_a_cached_grammar_is_reused_and_an_evicted_one_keeps_serving(tokenizer_dir, compiled, monkeypatch):
    refs, _ = compiled
    compiler = GrammarCompiler(tokenizer_dir, VOCAB_SIZE, [EOS])
    first = compiler.matcher(schema(0), "r0")
    compiler.matcher(schema(0), "r0-again")
    assert len(refs) == 1  # same spec, compiled once
    monkeypatch.setattr(structured_output, "GRAMMAR_CACHE_BYTES", 1, raising=False)
    compiler.matcher(schema(1), "r1")  # evicts schema 0 while `first` still runs
    from common.tokenizer import load_tokenizer
    brace, letter = (load_tokenizer(tokenizer_dir).convert_tokens_to_ids(t) for t in ("{", "a"))
    bitmask = xgrammar.allocate_token_bitmask(1, VOCAB_SIZE)
    first.fill_bitmask(bitmask, 0)
    def allowed(token: int) -> bool:
        return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

    assert allowed(brace) and not allowed(letter)
    first.accept(brace)
    assert first.active  # accepted: still inside the object
