"""Per-request sampling parameters: plain data that crosses sockets as msgpack."""
from __future__ import annotations

import msgspec

from common.errors import InvalidRequestError

_GREEDY_EPS = 1e-5


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to pick tokens for one request (field names follow vLLM's).

    `temperature == 0` means greedy. `max_tokens=None` means "whatever fits in
    max_model_len" and is resolved by the scheduler on admission.
    """

    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> "SamplingParams":
        """Raise InvalidRequestError naming the offending parameter; return self."""
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", f"temperature must be >= 0, got {self.temperature!r}")
        if self.temperature > 100:
            raise bad("temperature", f"temperature must be <= 100, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            raise bad("seed", f"seed must fit in 64 bits, got {self.seed!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "stop_token_ids must be non-negative integers")
        return self
