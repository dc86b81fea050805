"""Incremental detokenization: a growing list of token ids in, text deltas out.

Uses vLLM's prefix/read-offset technique. Decoding one token at a time is
wrong (byte-level BPE splits multi-byte characters across tokens, and
SentencePiece drops a token's leading space at the start of a decode), and
re-decoding everything each step is quadratic. Instead we decode a short
window twice: `ids[prefix:read]` (text already emitted) and `ids[prefix:]`
(with the new tokens); the delta is the tail by which the second is longer.
Text ending in U+FFFD is an unfinished character and is held back; at the
end of a request such a character is dropped, as vLLM does (its detokenizer
never releases it), so a reply cut by max_tokens inside a character does not
end in a stray U+FFFD.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as left context for the first output tokens, as in
# vLLM: enough for a SentencePiece space or a split character to resolve.
PROMPT_CONTEXT_TOKENS = 5


def _decode_function(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """The Rust tokenizer's decode when there is one (no Python overhead and
    no clean-up of spaces, so windows concatenate exactly), else transformers'."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    """Per-request detokenizer. `add_tokens` returns the new text; joined,
    the deltas and `flush()` equal `tokenizer.decode(output_ids,
    skip_special_tokens=...)` without its trailing U+FFFD, if any (for
    SentencePiece with a prompt: the text as continued after the prompt,
    i.e. keeping the first token's leading space).

    `spaces_between_special_tokens` is accepted for vLLM compatibility; like
    transformers and vLLM, fast tokenizers (the only kind we load) ignore it.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._decode = _decode_function(tokenizer, skip_special_tokens)
        prompt_tail = list(prompt_token_ids)[-PROMPT_CONTEXT_TOKENS:] if prompt_token_ids is not None else []
        context = [int(i) for i in prompt_tail]
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: output bytes cannot be split
            # from it, so the output is decoded on its own instead.
            context = []
        self._ids: list[int] = context  # context + every output token
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pieces: list[str] = []
        self._text_cache: str | None = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
        return self._text_cache

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (may be "")."""
        if len(new_token_ids) == 0:
            return ""
        self._ids.extend(int(i) for i in new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of a request: release the complete characters held back
        with an unfinished one; the unfinished bytes themselves (decoded as
        trailing U+FFFD) are dropped, as vLLM drops them."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if final:
            # Released text never ends in U+FFFD, so this strips only bytes of the last window.
            new_text = new_text.rstrip(REPLACEMENT_CHAR)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            # Nothing visible yet (a skipped special token) or a character
            # still waiting for its remaining bytes: keep the window open.
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._pieces.append(delta)
        self._text_cache = None
        return delta
