"""Build our model for a checkpoint and stream its safetensors weights in."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from common.config import EngineConfig
from common.model_files import resolve_model_dir
from common.parallel_layout import TensorShard
from worker.distributed.parallel_state import ParallelLayout
from common.pooling_params import is_bare_decoder_config
from worker.models import bare_checkpoint_names, check_architecture, get_model_class
from worker.models.llama import LlamaForCausalLM
from worker.quantization import checkpoint_weights

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[Path]:
    """The checkpoint's shards: those the index names, else every *.safetensors file."""
    root = Path(model_dir)
    index = root / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iterate_weights(files: list[Path], *, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, read one at a time to bound memory."""
    from safetensors import safe_open

    handles = [safe_open(str(path), framework="pt", device="cpu") for path in files]
    total = sum(len(handle.keys()) for handle in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update(1)


def load_hf_config(config: EngineConfig) -> tuple[Any, str]:
    """(the transformers config, the model directory) of `config.model`."""
    from transformers import AutoConfig

    model_dir = resolve_model_dir(config.model, config.model_cache_dir, revision=config.revision,
                                  gguf_file=config.gguf_file)
    check_architecture(model_dir)
    return AutoConfig.from_pretrained(model_dir, local_files_only=True), model_dir


def load_model(config: EngineConfig, device: str | torch.device, dtype: torch.dtype,
               layout: ParallelLayout = ParallelLayout()) -> tuple[LlamaForCausalLM, Any, str]:
    """(model in eval mode on `device` with `dtype`, the transformers config, the model directory);
    in a worker group, the part of the model `layout`'s rank holds (its shard of its stage).
    For a vision-language model the config is its text model's (what the KV cache is sized by)."""
    torch.manual_seed(config.seed)
    hf_config, model_dir = load_hf_config(config)
    model_class = get_model_class(hf_config)
    model = model_class(hf_config, dtype=dtype, device=device, shard=TensorShard(layout.tp_rank, layout.tp_size),
                        stage=(layout.pp_rank, layout.pp_size))
    weights = iterate_weights(safetensors_files(model_dir))
    if is_bare_decoder_config(hf_config):  # saved without the LM head and the `model.` prefix
        weights = bare_checkpoint_names(weights)
    model.load_weights(checkpoint_weights(model, weights))
    model.eval()
    logger.info("Loaded %s from %s (%s, %s, %.1fM parameters)", model_class.__name__, model_dir, dtype,
                device, sum(p.numel() for p in model.parameters()) / 1e6)
    return model, model.config, model_dir
