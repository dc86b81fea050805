"""vLLM's bad_words: from words to the token-id sequences the worker bans.

Each word is tokenized (without special tokens) twice: as written with its
leading whitespace stripped, which is how it looks at the start of a text,
and with one leading space, how it looks after another word. The spaced
spelling is kept only when it is a different word token of the same length
(its first token differs, its token count does not): otherwise it adds
nothing the plain one does not already ban, as vLLM decides.

The tokenizer lives in different places (the frontend's tokenizer pool, the
offline LLM's own), so tokenizing is the caller's: `spellings` says what to
encode and `bad_words_token_ids` combines the encodings.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams


def spellings(word: str) -> tuple[str, str]:
    """(the word at the start of a text, the word after another one)."""
    bare = word.lstrip()
    return bare, " " + bare


def bad_words_token_ids(words: Sequence[str], encoded: Sequence[tuple[list[int], list[int]]]) -> list[list[int]]:
    """The sequences to ban, given each word's encoded `spellings`."""
    banned: list[list[int]] = []
    for word, (plain, spaced) in zip(words, encoded):
        if not plain:
            raise InvalidRequestError(f"bad word {word!r} is no token at all", param="bad_words")
        banned.append(list(plain))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            banned.append(list(spaced))
    return banned


def with_bad_words_tokenized(params: SamplingParams, encode: Callable[[str], list[int]]) -> SamplingParams:
    """`params` with its bad_words tokenized by `encode` (text -> ids, no special tokens)."""
    if not params.bad_words:
        return params
    encoded = [tuple(encode(text) for text in spellings(word)) for word in params.bad_words]
    return msgspec.structs.replace(params, bad_words_token_ids=bad_words_token_ids(params.bad_words, encoded))
