"""Embedding (pooling) requests: what a request asks for, and how the served model pools.

A pooling request runs its prompt through the model (prefill only) and returns one vector
made of the final hidden states instead of sampling: LAST (the last token, as Qwen3-Embedding),
MEAN (over every prompt token) or CLS (the first token), then optionally truncated to
`dimensions` (Matryoshka models only) and L2-normalised, as vLLM's `--runner pooling`.
The worker announces its `PoolerInfo` in its hello; the scheduler resolves each request's
`PoolingParams` against it (`PoolerInfo.resolve`), so the worker gets complete parameters.
"""
from __future__ import annotations

import json
from typing import Any

import msgspec

from common.errors import ConfigError, InvalidRequestError

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One request's pooling options (vLLM's names). None: the model's default."""
    dimensions: int | None = None  # keep the first `dimensions` values (Matryoshka), then normalise
    normalize: bool | None = None
    pooling_type: str | None = None  # set by the scheduler from the worker's PoolerInfo


class PoolerConfig(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    """`--pooler-config`: overrides of the model's pooling (vLLM's JSON keys)."""
    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            self.pooling_type = self.pooling_type.upper()
            if self.pooling_type not in POOLING_TYPES:
                raise ConfigError(f"pooler_config: pooling_type must be one of {POOLING_TYPES}, "
                                  f"got {self.pooling_type!r}")

    @classmethod
    def parse(cls, value: "str | dict | PoolerConfig | None") -> "PoolerConfig | None":
        """From the CLI's JSON text, the offline LLM's dict, or a config; None stays None."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"pooler_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"pooler_config must be a JSON object, got {type(value).__name__}")
        try:
            return msgspec.convert(value, cls)
        except msgspec.ValidationError as e:
            raise ConfigError(f"pooler_config: {e}") from None

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()


class PoolerInfo(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How a pooling worker pools: its defaults and the size of its vectors."""
    pooling_type: str
    normalize: bool
    hidden_size: int
    is_matryoshka: bool = False  # the model allows `dimensions` below hidden_size
    matryoshka_dimensions: list[int] | None = None  # the sizes it allows, when it lists them
    bidirectional: bool = False  # an encoder (BERT): whole prompts, no KV cache, no chunking

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """The request's parameters with every default filled; InvalidRequestError naming the cause."""
        dims = params.dimensions
        if dims is not None:
            if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
                raise InvalidRequestError(f"dimensions must be a positive integer, got {dims!r}", param="dimensions")
            if dims != self.hidden_size:
                if not self.is_matryoshka:
                    raise InvalidRequestError(
                        f"This model does not support Matryoshka representation: dimensions must be "
                        f"{self.hidden_size} (its embedding size) or left out, got {dims}", param="dimensions")
                if dims > self.hidden_size:
                    raise InvalidRequestError(f"dimensions ({dims}) is more than the model's embedding size "
                                              f"({self.hidden_size})", param="dimensions")
                if self.matryoshka_dimensions and dims not in self.matryoshka_dimensions:
                    raise InvalidRequestError(f"dimensions must be one of {self.matryoshka_dimensions} for "
                                              f"this model, got {dims}", param="dimensions")
            else:
                dims = None
        normalize = self.normalize if params.normalize is None else bool(params.normalize)
        return PoolingParams(dimensions=dims, normalize=normalize, pooling_type=self.pooling_type)


def model_pooler_defaults(model_dir: str, hf_config: Any) -> tuple[str, bool]:
    """(pooling type, normalise) the model's files ask for: sentence-transformers'
    `modules.json` (a Pooling module's `1_Pooling/config.json`, a Normalize module) when
    present, else vLLM's defaults (CLS and normalised for BERT, LAST and normalised for decoders)."""
    from pathlib import Path

    root = Path(model_dir)
    encoder = is_encoder_config(hf_config)
    pooling_type, normalize = ("CLS" if encoder else "LAST"), True
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return pooling_type, normalize
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{modules_file} is not readable JSON: {e}") from None
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m.get("path", "") for m in modules if isinstance(m, dict)}
    normalize = "Normalize" in kinds
    if "Pooling" in kinds:
        pooling_file = root / kinds["Pooling"] / "config.json"
        try:
            pooling = json.loads(pooling_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{pooling_file} is not readable JSON: {e}") from None
        pooling_type = _sentence_transformers_mode(pooling, pooling_file)
    return pooling_type, normalize


def _sentence_transformers_mode(pooling: dict, source: Any) -> str:
    if pooling.get("pooling_mode_lasttoken"):
        return "LAST"
    if pooling.get("pooling_mode_cls_token"):
        return "CLS"
    if pooling.get("pooling_mode_mean_tokens"):
        return "MEAN"
    mode = str(pooling.get("pooling_mode", "")).lower()
    named = {"lasttoken": "LAST", "cls": "CLS", "mean": "MEAN"}.get(mode)
    if named is None:
        raise ConfigError(f"{source}: only lasttoken, cls and mean pooling are supported, got {pooling}")
    return named


def is_encoder_config(hf_config: Any) -> bool:
    """A BERT-style bidirectional encoder (served by the worker's encoder path)."""
    return "BertModel" in (getattr(hf_config, "architectures", None) or [])


# Decoder checkpoints saved as the bare transformer (no LM head, tensor names without the
# `model.` prefix), as embedding models are (Qwen3-Embedding): the causal-LM class that runs
# them. They can only pool.
BARE_DECODER_ARCHITECTURES = {
    "Gemma2Model": "Gemma2ForCausalLM",
    "Gemma3TextModel": "Gemma3ForCausalLM",
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "MixtralModel": "MixtralForCausalLM",
    "Phi3Model": "Phi3ForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen2MoeModel": "Qwen2MoeForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "Qwen3MoeModel": "Qwen3MoeForCausalLM",
}


def is_bare_decoder_config(hf_config: Any) -> bool:
    """A decoder without its LM head (BARE_DECODER_ARCHITECTURES): pooling only."""
    architectures = getattr(hf_config, "architectures", None) or []
    return bool(architectures) and architectures[0] in BARE_DECODER_ARCHITECTURES


def pooling_only_config(hf_config: Any) -> bool:
    """Whether the model can only pool (`--runner auto` resolves to pooling for it)."""
    return is_encoder_config(hf_config) or is_bare_decoder_config(hf_config)


def matryoshka_info(hf_config: Any) -> tuple[bool, list[int] | None]:
    """vLLM's config keys: `is_matryoshka` or `matryoshka_dimensions` (the allowed sizes)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return bool(getattr(hf_config, "is_matryoshka", False) or dims), (list(dims) if dims else None)
