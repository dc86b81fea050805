"""How a worker group splits a model: which part of each weight a tensor-parallel
rank holds (Megatron-style), and which layers a pipeline stage holds. Pure
arithmetic on the model's config, so that `serve` and the offline LLM check a
layout before any rank starts.

Key/value heads are split across ranks, each with the query heads that attend
through it (its GQA group), so attention needs no communication. Where the KV
heads do not divide evenly (SmolLM2-135M: 3 KV heads, 9 query heads, on two
ranks) the first ranks take one more; where there are fewer KV heads than
ranks, each rank holds the one KV head its share of the query heads uses
(replicated across ranks, as vLLM does). MLP columns are split the same way
(near-equal shares). The vocabulary is split in equal, padded shares, because
the logits are gathered in equal parts (the padding rows are zero and masked).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.errors import ConfigError

if TYPE_CHECKING:
    from common.config import EngineConfig


@dataclass(frozen=True, slots=True)
class TensorShard:
    rank: int = 0
    size: int = 1

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(start, count) of this rank's near-equal share of `total` (earlier ranks take the remainder)."""
        if total < self.size:
            raise ConfigError(f"tensor_parallel_size {self.size} exceeds the model's {total} {what}")
        base, extra = divmod(total, self.size)
        return self.rank * base + min(self.rank, extra), base + (1 if self.rank < extra else 0)

    def attention_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int, int, int]:
        """(first query head, query heads, first KV head, KV heads) this rank holds."""
        group = num_heads // num_kv_heads
        if num_kv_heads >= self.size:
            kv_start, kv_count = self.split(num_kv_heads, "key/value heads")
            return kv_start * group, kv_count * group, kv_start, kv_count
        if self.size % num_kv_heads or num_heads % self.size:
            raise ConfigError(f"tensor_parallel_size {self.size} exceeds the model's {num_kv_heads} key/value "
                              f"heads: it must then be a multiple of them and divide the {num_heads} query heads")
        q_count = num_heads // self.size
        q_start = self.rank * q_count
        return q_start, q_count, q_start // group, 1

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(first token id, padded rows per rank, real rows on this rank)."""
        rows = -(-vocab_size // self.size)
        start = self.rank * rows
        return start, rows, max(0, min(rows, vocab_size - start))


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[first, end) of the layers pipeline stage `pp_rank` of `pp_size` holds: consecutive,
    near-equal runs, earlier stages taking the remainder (the last stage also runs the lm_head)."""
    if pp_size > num_layers:
        raise ConfigError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    first = pp_rank * base + min(pp_rank, extra)
    return first, first + base + (1 if pp_rank < extra else 0)


def check_model_layout(config: "EngineConfig") -> None:
    """check_layout for `config`'s model and group sizes (a no-op for one rank)."""
    if config.world_size == 1:
        return
    import json
    import os

    from common.model_files import resolve_model_dir
    model_dir = resolve_model_dir(config.model, config.model_cache_dir, revision=config.revision,
                                  gguf_file=config.gguf_file)
    with open(os.path.join(model_dir, "config.json")) as f:
        model_config = json.load(f)
    model_config = model_config.get("text_config", model_config)
    check_layout(model_config, config.tensor_parallel_size, config.pipeline_parallel_size)


def check_layout(model_config: dict, tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """ConfigError unless every rank can hold its part of the model whose config.json is `model_config`."""
    heads = model_config["num_attention_heads"]
    kv_heads = model_config.get("num_key_value_heads") or heads
    for rank in range(tensor_parallel_size):
        shard = TensorShard(rank, tensor_parallel_size)
        shard.attention_heads(heads, kv_heads)
        shard.split(model_config["intermediate_size"], "MLP columns")
    for stage in range(pipeline_parallel_size):
        stage_layers(model_config["num_hidden_layers"], stage, pipeline_parallel_size)
