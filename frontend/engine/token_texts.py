"""Each token's own text and UTF-8 bytes, as logprobs report them (the
`Generator` keeps one `TokenTexts` per tokenizer; the APIs format logprobs
with it)."""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE
    token uses for each byte -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return {char: byte for byte, char in chars.items()}


class TokenTexts:
    """Each token's own text and UTF-8 bytes, cached. A token holding part of
    a multi-byte character decodes to U+FFFD; its bytes are still exact for
    byte-level BPE tokenizers (read from the token's byte-level spelling)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            raw = list(text.encode("utf-8"))
            if self._byte_level and token_id not in self._added:
                spelling = self.tokenizer.convert_ids_to_tokens(token_id) or ""
                table = _byte_level_chars()
                if all(char in table for char in spelling):
                    raw = [table[char] for char in spelling]
            entry = self._cache[token_id] = (text, raw)
        return entry
