"""BERT-style encoder (transformers' `BertModel`) over a flattened batch of whole sequences:
token ids in, final hidden states (`last_hidden_state`) out.

Bidirectional attention within each sequence (no causal mask, no KV cache: every step runs
whole prompts), absolute position and token-type embeddings, post-LayerNorm residual
blocks and an exact-erf GELU MLP, op for op as transformers' eager code. Submodules carry
transformers' names so a checkpoint's state dict loads as it is (`load_bert_weights`).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int, dtype, device):
        super().__init__()
        self.query = nn.Linear(hidden, hidden, dtype=dtype, device=device)
        self.key = nn.Linear(hidden, hidden, dtype=dtype, device=device)
        self.value = nn.Linear(hidden, hidden, dtype=dtype, device=device)


class _DenseNorm(nn.Module):
    """A dense layer whose output joins the residual, then LayerNorm (BertSelfOutput, BertOutput)."""

    def __init__(self, in_features: int, hidden: int, eps: float, dtype, device):
        super().__init__()
        self.dense = nn.Linear(in_features, hidden, dtype=dtype, device=device)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype, device):
        super().__init__()
        self.self = _SelfAttention(hidden, dtype, device)
        self.output = _DenseNorm(hidden, hidden, eps, dtype, device)


class _Intermediate(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype, device):
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate, dtype=dtype, device=device)


class BertLayer(nn.Module):
    def __init__(self, hf_config: Any, dtype, device):
        super().__init__()
        h, eps = hf_config.hidden_size, hf_config.layer_norm_eps
        self.num_heads = hf_config.num_attention_heads
        self.attention = _Attention(h, eps, dtype, device)
        self.intermediate = _Intermediate(h, hf_config.intermediate_size, dtype, device)
        self.output = _DenseNorm(hf_config.intermediate_size, h, eps, dtype, device)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        attn = self.attention.self
        tokens, hidden = x.shape
        head_dim = hidden // self.num_heads

        def heads(t: torch.Tensor) -> torch.Tensor:  # [T, H] -> [heads, T, head_dim]
            return t.view(tokens, self.num_heads, head_dim).transpose(0, 1)

        q, k, v = heads(attn.query(x)), heads(attn.key(x)), heads(attn.value(x))
        context = torch.empty_like(q)
        start = 0
        for n in seq_lens:  # each sequence attends to all of itself, nothing else
            s = slice(start, start + n)
            context[:, s] = F.scaled_dot_product_attention(q[:, s], k[:, s], v[:, s])
            start += n
        context = context.transpose(0, 1).reshape(tokens, hidden)
        x = self.attention.output(context, x)
        return self.output(F.gelu(self.intermediate.dense(x)), x)


class _Embeddings(nn.Module):
    def __init__(self, hf_config: Any, dtype, device):
        super().__init__()
        h = hf_config.hidden_size
        self.word_embeddings = nn.Embedding(hf_config.vocab_size, h, dtype=dtype, device=device)
        self.position_embeddings = nn.Embedding(hf_config.max_position_embeddings, h, dtype=dtype, device=device)
        self.token_type_embeddings = nn.Embedding(hf_config.type_vocab_size, h, dtype=dtype, device=device)
        self.LayerNorm = nn.LayerNorm(h, eps=hf_config.layer_norm_eps, dtype=dtype, device=device)


class _Encoder(nn.Module):
    def __init__(self, hf_config: Any, dtype, device):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(hf_config, dtype, device) for _ in range(hf_config.num_hidden_layers))


class BertModel(nn.Module):
    """The encoder; `forward(input_ids, positions, seq_lens)` with token type 0 everywhere
    (single-segment inputs, as an embedding request has)."""

    def __init__(self, hf_config: Any, *, dtype: torch.dtype | None = None, device: Any = None):
        super().__init__()
        check_bert_config(hf_config)
        self.embeddings = _Embeddings(hf_config, dtype, device)
        self.encoder = _Encoder(hf_config, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        e = self.embeddings
        x = e.word_embeddings(input_ids) + e.position_embeddings(positions) + e.token_type_embeddings.weight[0]
        x = e.LayerNorm(x)
        for layer in self.encoder.layer:
            x = layer(x, seq_lens)
        return x


def check_bert_config(hf_config: Any) -> None:
    """ValueError for a BERT variant this implementation would compute wrongly."""
    kind = getattr(hf_config, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"BERT with position_embedding_type {kind!r} is not supported (only 'absolute')")
    act = getattr(hf_config, "hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"BERT with hidden_act {act!r} is not supported (only 'gelu')")
    if getattr(hf_config, "is_decoder", False):
        raise ValueError("a BERT configured as a decoder (is_decoder) is not an encoder")


def load_bert_weights(model: BertModel, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load a BertModel checkpoint (or a task model's `bert.` part); the pooler head and task
    heads are not used. Old checkpoints' LayerNorm `gamma`/`beta` load as weight/bias."""
    wanted = model.state_dict()
    loaded: set[str] = set()
    for name, tensor in weights:
        name = name.removeprefix("bert.").replace("LayerNorm.gamma", "LayerNorm.weight") \
            .replace("LayerNorm.beta", "LayerNorm.bias")
        if name not in wanted:
            if name.startswith(("embeddings.", "encoder.")) and not name.endswith("position_ids"):
                raise ValueError(f"unexpected BERT weight {name!r}")
            continue  # pooler.*, cls.*, buffers
        if tuple(tensor.shape) != tuple(wanted[name].shape):
            raise ValueError(f"BERT weight {name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(wanted[name].shape)}")
        with torch.no_grad():
            wanted[name].copy_(tensor)
        loaded.add(name)
    missing = sorted(set(wanted) - loaded)
    if missing:
        raise ValueError(f"the checkpoint lacks BERT weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
