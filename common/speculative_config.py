"""`--speculative-config`: what proposes draft tokens, and how many.

The JSON is vLLM's: `{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}` proposes the tokens that
followed the latest earlier occurrence of the sequence's last n tokens (prompt
lookup); `{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}`
runs a smaller model with the same vocabulary in the worker, greedily, with its
own paged KV cache. The target model checks every draft in one forward pass
(worker.spec_decode). `disable_by_batch_size`: no speculation in steps with at
least that many running requests (where a batch is bound by compute, verifying
drafts costs more than it saves).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from common.errors import ConfigError

METHODS = ("ngram", "draft_model")
# Measured on the AMX Xeon (docs/benchmarks.md, "Speculative decoding"): where drafts are mostly
# rejected (sampled text), checking them is even at 4 running requests and costs from 16 on.
DEFAULT_DISABLE_BY_BATCH_SIZE = 16


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up
    prompt_lookup_min: int = 2  # ngram: the shortest
    model: str | None = None  # draft_model: a path or a name `--model` accepts
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("speculative_config: num_speculative_tokens must be an integer from 1 to 16, "
                              f"got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ConfigError("speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                  f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
            if self.model is not None:
                raise ConfigError("speculative_config: method 'ngram' takes no model")
        elif not self.model:
            raise ConfigError("speculative_config: method 'draft_model' needs \"model\": a model path or name")
        if self.disable_by_batch_size < 1:
            raise ConfigError(f"speculative_config: disable_by_batch_size must be at least 1, "
                              f"got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From the CLI's JSON text, the offline LLM's dict, or a config; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str) and not value.strip():
            return None  # an empty setting (PAGEDSERVE_SPECULATIVE_CONFIG=) is none
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object")
        settings: dict[str, Any] = dict(value)
        # vLLM's older spelling: speculative_model="[ngram]" and ngram_prompt_lookup_max/min.
        legacy = settings.pop("speculative_model", None)
        if legacy is not None:
            settings.setdefault("method", "ngram" if legacy == "[ngram]" else "draft_model")
            if legacy != "[ngram]":
                settings.setdefault("model", legacy)
        for old, new in (("ngram_prompt_lookup_max", "prompt_lookup_max"),
                         ("ngram_prompt_lookup_min", "prompt_lookup_min"),
                         ("speculative_disable_by_batch_size", "disable_by_batch_size")):
            if old in settings:
                settings.setdefault(new, settings.pop(old))
        if settings.get("method") in ("draft", "draft-model"):
            settings["method"] = "draft_model"
        if "method" not in settings:
            settings["method"] = "draft_model" if settings.get("model") else "ngram"
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in settings:
            raise ConfigError("speculative_config: num_speculative_tokens is required")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            if key in settings and (not isinstance(settings[key], int) or isinstance(settings[key], bool)):
                raise ConfigError(f"speculative_config: {key} must be an integer, got {settings[key]!r}")
        return cls(**settings)

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}, separators=(",", ":"))

    @property
    def lookahead_slots(self) -> int:
        """KV slots past the verified tokens that a step writes: a draft model runs ahead to propose."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0
