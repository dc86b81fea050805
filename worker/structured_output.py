"""Structured outputs on the worker: one xgrammar matcher per constrained
request, and the masks that keep each step's sampling inside its grammar.

A matcher follows its request's output tokens. The worker drops a request's
state when it is preempted (and rebuilds it on re-admission), so a new
matcher replays the outputs generated so far: the constraint holds across
preemption and worker restarts. Grammars are compiled once per spec and
cached, least recently used first out once the cache holds GRAMMAR_CACHE_BYTES
(clients that send a new schema with every request must not grow the worker
without bound: one compiled JSON schema can take a megabyte); compiling
happens on the worker thread when a request first arrives (typically
milliseconds; a large JSON schema may take longer). What every grammar needs
first, xgrammar's view of the tokenizer (about a second for a 50k
vocabulary), is built in the background when the worker starts, so the first
structured request does not stall every other request's step.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from common.structured_outputs import StructuredOutputs, build_grammar

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_BYTES = 512 * 1024 * 1024  # as vLLM's VLLM_XGRAMMAR_CACHE_MB default


class GrammarMatcher:
    """Where one request stands in its grammar."""

    def __init__(self, matcher: Any, request_id: str, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._request_id = request_id
        self._broken = False  # a token the grammar refused: stop constraining rather than fail the step

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (not once the grammar accepted its end)."""
        return not self._broken and not self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        if not self.active:
            return
        if not self._matcher.accept_token(token_id):
            # Only possible when another adjustment (min_tokens banning the end, a logit bias of -100)
            # left nothing the grammar allows. Masking on from a state the output no longer
            # matches would be arbitrary; the text is what the client gets either way.
            logger.warning("request %s: sampled token %d is outside its grammar; no longer constraining it",
                           self._request_id, token_id)
            self._broken = True


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer (built on first use: xgrammar
    and the tokenizer load only when a request asks for structured output)."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer_dir = tokenizer_dir
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()  # held while it is built: a first request waits for the warm-up
        # By the spec's encoding (a choice list is not hashable), least recently used first.
        self._compiled: OrderedDict[bytes, Any] = OrderedDict()
        self._compiled_bytes = 0
        self._warm_up_thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        """Whether the tokenizer info is built (a new grammar then compiles in milliseconds)."""
        return self._compiler is not None

    def start_warm_up(self) -> None:
        """Build the tokenizer info in a background thread (first use waits for it).

        Not a daemon: the interpreter joins it before exiting. A process that exited while
        it ran inside xgrammar's native code aborted ("terminate called without an active
        exception"), e.g. a short `bench perplexity` run in a fresh checkout."""
        self._warm_up_thread = threading.Thread(target=self._warm_up, name="grammar-warm-up", daemon=False)
        self._warm_up_thread.start()

    def wait_for_warm_up(self, timeout_s: float | None = None) -> bool:
        """Whether the tokenizer info is built, once a started warm-up has ended."""
        if self._warm_up_thread is not None:
            self._warm_up_thread.join(timeout_s)
        return self.ready

    def _warm_up(self) -> None:
        try:
            self._xgrammar_compiler()
        except Exception:  # e.g. a test model without a tokenizer: reported per request if one needs it
            logger.debug("cannot prepare structured outputs for this tokenizer", exc_info=True)

    def matcher(self, spec: StructuredOutputs, request_id: str, output_token_ids: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher for `spec` that has accepted `output_token_ids` (a request re-admitted after preemption)."""
        import xgrammar

        matcher = GrammarMatcher(xgrammar.GrammarMatcher(self._compile(spec)), request_id, self._vocab_size)
        for token_id in output_token_ids:
            matcher.accept(token_id)
        return matcher

    def _compile(self, spec: StructuredOutputs) -> Any:
        key = msgspec.msgpack.encode(spec)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        compiled = self._compiled[key] = self._xgrammar_compiler().compile_grammar(build_grammar(spec))
        self._compiled_bytes += compiled.memory_size_bytes
        # Matchers hold their own reference: evicting a grammar never breaks a running request.
        while self._compiled_bytes > GRAMMAR_CACHE_BYTES and len(self._compiled) > 1:
            self._compiled_bytes -= self._compiled.popitem(last=False)[1].memory_size_bytes
        return compiled

    def _xgrammar_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                from common.tokenizer import load_tokenizer

                info = xgrammar.TokenizerInfo.from_huggingface(load_tokenizer(self._tokenizer_dir),
                                                               vocab_size=self._vocab_size,
                                                               stop_token_ids=self._eos_token_ids or None)
                # One thread: the model owns the cores. No cache of xgrammar's own (unbounded by
                # default): the one above is bounded.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


class GrammarMasks:
    """The allowed tokens of a step's constrained rows, as xgrammar bitmasks."""

    def __init__(self, rows: list[int], matchers: list[GrammarMatcher], num_rows: int):
        import xgrammar

        self.rows = rows
        # One bitmask row per logits row (xgrammar's kernel indexes both alike); only `rows` are filled.
        self.bitmask = xgrammar.allocate_token_bitmask(num_rows, matchers[0].vocab_size)
        for row, matcher in zip(rows, matchers):
            matcher.fill_bitmask(self.bitmask, row)

    def apply(self, logits: torch.Tensor) -> None:
        """Set every token the grammars forbid to -inf (in place), with xgrammar's
        kernel (about twice as fast as unpacking the bits with torch ops on CPU)."""
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, self.bitmask.to(logits.device), indices=self.rows)


def grammar_masks(matchers: Sequence[GrammarMatcher | None]) -> GrammarMasks | None:
    """Masks for the rows whose matcher is active; None when no row is constrained."""
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None and matcher.active]
    if not rows:
        return None
    return GrammarMasks(rows, [matchers[row] for row in rows], len(matchers))  # type: ignore[misc]
