"""The model creator's sampling defaults, from generation_config.json, as
vLLM's `--generation-config auto` (its default): a request that leaves
temperature, top_p, top_k, min_p or repetition_penalty unset gets the model's
value instead of the API's. `vllm` ignores the file; a directory path reads
generation_config.json there instead of the model's.

Like vLLM, only values that differ from transformers' own GenerationConfig
defaults count (so a file's `"top_k": 50`, transformers' default, changes
nothing).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
from typing import Any

from common.errors import ConfigError

logger = logging.getLogger(__name__)

SOURCES_HELP = ("'auto' (the model's generation_config.json), 'vllm' (ignore it) or a directory holding a "
                "generation_config.json")
# Sampling fields read from the file -> transformers' GenerationConfig default for each.
_TRANSFORMERS_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
                                          "repetition_penalty": 1.0}


def generation_config_source(text: str) -> str:
    """--generation-config's type: 'auto', 'vllm', or a directory with a generation_config.json
    (made absolute). Checked when the flags are parsed, so a bad one never starts a frontend."""
    if text in ("auto", "vllm"):
        return text
    path = os.path.abspath(os.path.expanduser(text))
    if not os.path.isfile(os.path.join(path, "generation_config.json")):
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto', 'vllm' nor a directory holding a "
                                         "generation_config.json")
    return path


def sampling_defaults(model_dir: str | None, source: str = "auto") -> dict[str, float | int]:
    """The sampling fields the model's generation config sets, e.g. {"temperature": 0.6}."""
    if source == "vllm" or (source == "auto" and model_dir is None):
        return {}
    directory = model_dir if source == "auto" else source
    path = os.path.join(directory or "", "generation_config.json")
    if not os.path.isfile(path):
        if source != "auto":
            raise ConfigError(f"--generation-config {source}: no generation_config.json there")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    defaults = {}
    for name, transformers_default in _TRANSFORMERS_DEFAULTS.items():
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        if value != transformers_default:
            defaults[name] = int(value) if name == "top_k" else float(value)
    if defaults:
        logger.info("Default sampling parameters come from the model's generation config (--generation-config "
                    "vllm to ignore it): %s", defaults)
    return defaults
