"""Random sampling of rows of logits: temperature, min-p, top-k, top-p, then a race.

For probabilities p and independent E_i ~ Exp(1), argmax(p_i / E_i) is
distributed exactly as p; in logs, with E = -log u for u ~ Uniform(0, 1), the
pick is argmax(s_i - log(-log u_i)) over the scaled logits s (the Gumbel-max
trick). Sampling is then an elementwise op and an argmax, with no softmax.

The noise is counter-based: u(key, token) is splitmix64 of the row's 64-bit key
and the token id, so it is the same for a token wherever the row sits in a
batch, on any device and in the C++ kernel. A seeded request's key is a pure
function of its seed and output index (`worker.sampler.step_seed`); the other
rows take keys from the engine's generator.

Filter order follows vLLM: temperature, then min-p, top-k (the k largest and
every token tied with the k-th), and last top-p on the distribution top-k left
(renormalized): the smallest prefix, by descending probability, whose mass
reaches p; the most likely token always stays.

On CPU the C++ kernel (`worker/csrc/random_sampling.cpp`) does all of it; the
PyTorch version below is its reference and the path for other devices.
"""
from __future__ import annotations

import torch

from worker.kernels import cpu_ops

GOLDEN = 0x9E3779B97F4A7C15
MIX_1 = 0xBF58476D1CE4E5B9
MIX_2 = 0x94D049BB133111EB
UNIFORM_BITS = 23  # u = (m + 0.5) / 2^23: exact in float32, never 0 or 1


def as_int64(value: int) -> int:
    """A 64-bit unsigned value as the int64 with the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """u(key, token) in (0, 1), float32 [rows, vocab], for int64 keys [rows] (int64
    arithmetic wraps like the uint64 of splitmix64)."""
    tokens = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device)
    z = keys.unsqueeze(1) + tokens * as_int64(GOLDEN)
    z = (z ^ _shift_right(z, 30)) * as_int64(MIX_1)
    z = (z ^ _shift_right(z, 27)) * as_int64(MIX_2)
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 64 - UNIFORM_BITS).float() + 0.5) * 2.0 ** -UNIFORM_BITS


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the top probability.

    p_i < m * p_max  <=>  logit_i < logit_max + log(m), so no softmax is needed;
    rows with min_p = 0 get a threshold of -inf and keep everything.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask all but each row's top-k (0: all), then all but the smallest
    top-p prefix of what is left. Only the rows that use a filter are sorted."""
    active = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    if top_k is not None:
        active |= top_k > 0
    if top_p is not None:
        active |= top_p < 1.0
    rows = active.nonzero().squeeze(1)
    if rows.numel() == 0:
        return logits
    vocab = logits.shape[1]
    k = top_k.index_select(0, rows) if top_k is not None else torch.zeros_like(rows)
    k = torch.where(k > 0, k.clamp(max=vocab), torch.full_like(k, vocab))
    p = top_p.index_select(0, rows) if top_p is not None else torch.ones(rows.numel(), device=logits.device)
    filtered = top_k_top_p_sorted(logits.index_select(0, rows), k, p)
    if rows.numel() == logits.shape[0]:
        return filtered
    out = logits.clone()
    out[rows] = filtered
    return out


def top_k_top_p_sorted(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """k: [R] in [1, vocab]; p: [R]. Masses in float64, as the kernel sums them."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))  # ties with the k-th stay
    probs = sorted_logits.double().softmax(dim=-1)
    # Mass strictly before each token: a token is kept while that is < p, so the
    # kept set is the smallest prefix reaching p. The first token always stays.
    mass_before = probs.cumsum(dim=-1) - probs
    ranks = torch.arange(logits.shape[1], device=logits.device)
    drop = (mass_before >= p.double().unsqueeze(1)) & (ranks > 0)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample_random_rows_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                                 top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                                 keys: torch.Tensor) -> torch.Tensor:
    """Token ids [R] for logits [R, vocab] (any float dtype), in PyTorch."""
    scaled = logits.float() / temperature.unsqueeze(1)
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    if top_k is not None or top_p is not None:
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    noise = counter_uniform(keys, logits.shape[1])
    return (scaled - noise.log_().neg_().log_()).argmax(dim=-1)


def sample_random_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None, min_p: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """`sample_random_rows_reference`, by the C++ kernel for CPU float32/bfloat16 logits when it is built."""
    if (logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16)
            or cpu_ops.load() is None):
        return sample_random_rows_reference(logits, temperature, top_k, top_p, min_p, keys)
    rows = logits.shape[0]
    return cpu_ops.sample_random_rows(
        logits.contiguous(), temperature.float().contiguous(),
        top_k.contiguous() if top_k is not None else torch.zeros(rows, dtype=torch.int64),
        top_p.float().contiguous() if top_p is not None else torch.ones(rows),
        min_p.float().contiguous() if min_p is not None else torch.zeros(rows),
        keys.contiguous())
