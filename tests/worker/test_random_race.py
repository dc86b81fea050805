"""Random sampling: the counter-based noise, and the C++ kernel against its PyTorch reference."""
from __future__ import annotations

import pytest
import torch

from worker.kernels import cpu_extension, cpu_ops
from worker.random_race import (apply_min_p, apply_top_k_top_p, as_int64, counter_uniform, sample_random_rows,
                                sample_random_rows_reference)

MASK_64 = (1 << 64) - 1


def splitmix_uniform(key: int, token: int) -> float:
    """The noise's definition in plain Python integers."""
    z = (key + (token + 1) * 0x9E3779B97F4A7C15) & MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK_64
    z ^= z >> 31
    return ((z >> 41) + 0.5) / 2 ** 23


def test_noise_is_splitmix64_of_key_and_token():
    keys = [0, 1, -1, 2 ** 63 - 1, -(2 ** 63), 0x0123456789ABCDEF]
    noise = counter_uniform(torch.tensor(keys, dtype=torch.int64), 40)
    for row, key in enumerate(keys):
        assert noise[row].tolist() == [splitmix_uniform(key & MASK_64, token) for token in range(40)]
    assert 0.0 < noise.min().item() and noise.max().item() < 1.0


def test_noise_is_uniform_and_independent_of_the_batch():
    noise = counter_uniform(torch.arange(64, dtype=torch.int64) * 7919, 4096)
    counts = torch.histc(noise, bins=16, min=0.0, max=1.0)
    assert (counts - noise.numel() / 16).abs().max() < 5 * (noise.numel() / 16) ** 0.5
    alone = counter_uniform(torch.tensor([5 * 7919]), 4096)
    assert torch.equal(alone[0], noise[5])


def test_as_int64_keeps_the_bits():
    assert as_int64(2 ** 64 - 1) == -1 and as_int64(2 ** 63) == -(2 ** 63) and as_int64(5) == 5


def kept_sets(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    scaled = logits.float() / temperature.unsqueeze(1)
    if min_p is not None:
        scaled = apply_min_p(scaled, min_p)
    return torch.isfinite(apply_top_k_top_p(scaled, top_k, top_p))


def regimes(rows: int, vocab: int, seed: int):
    """Logits of several shapes with filters of every kind, some rows masked in part."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.05, 0.5, 3.0, 12.0]).repeat(rows // 4).unsqueeze(1)
    logits = torch.randn(rows, vocab, generator=gen) * scale
    logits[1::7, ::3] = float("-inf")  # masks (allowed_token_ids, grammars)
    logits[2::9, : vocab // 2] = logits[2::9, :1]  # many ties
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.1
    top_k = torch.randint(0, 80, (rows,), generator=gen)
    top_k[::3] = 0
    top_k[5::11] = vocab + 10
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.1
    top_p[::4] = 1.0
    top_p[7::13] = 1e-46  # 0 in float32: the top token alone
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.3, torch.rand(rows, generator=gen) * 0.2,
                        torch.zeros(rows))
    keys = torch.randint(-2 ** 63, 2 ** 63 - 1, (rows,), generator=gen)
    return logits, temperature, top_k, top_p, min_p, keys


needs_kernel = pytest.mark.skipif(not cpu_extension.expected(), reason="no C++ compiler, or PAGEDSERVE_CPU_KERNELS=0")


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 7, 16, 333, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_samples_what_the_reference_samples(vocab, dtype):
    logits, temperature, top_k, top_p, min_p, keys = regimes(256, vocab, seed=vocab)
    logits = logits.to(dtype)
    for filters in [(None, None, None), (top_k, None, None), (None, top_p, None), (None, None, min_p),
                    (top_k, top_p, min_p)]:
        ours = sample_random_rows(logits, temperature, *filters, keys)
        reference = sample_random_rows_reference(logits, temperature, *filters, keys)
        kept = kept_sets(logits, temperature, *filters)
        live = kept.any(dim=1)  # else every token is masked and both give token 0
        assert kept.gather(1, ours.unsqueeze(1))[live].all(), "a filtered token was sampled"
        assert (ours[~live] == 0).all()
        # The two logs differ in the last bit at most: only a near tie of two scores could differ.
        assert (ours != reference).sum().item() <= 2


@needs_kernel
def test_kernel_keeps_exactly_the_filtered_sets():
    """Over many keys the kernel's draws cover the kept set and nothing else."""
    probs = torch.tensor([0.3, 0.2, 0.2, 0.12, 0.08, 0.05, 0.03, 0.02])
    rows = 6000
    logits = probs.log().unsqueeze(0).expand(rows, -1).contiguous()
    keys = torch.arange(rows, dtype=torch.int64) * 0x9E3779B9
    ones = torch.ones(rows)
    for top_k, top_p, min_p, expected in [(2, 1.0, 0.0, {0, 1, 2}),  # the k-th's tie stays
                                          (0, 0.55, 0.0, {0, 1, 2}), (0, 0.45, 0.0, {0, 1}),
                                          (4, 0.8, 0.0, {0, 1, 2}), (0, 1.0, 0.3, {0, 1, 2, 3}),
                                          (0, 1e-46, 0.0, {0})]:
        ids = sample_random_rows(logits, ones, torch.full((rows,), top_k), torch.full((rows,), top_p),
                                 torch.full((rows,), min_p), keys)
        assert set(ids.tolist()) == expected, (top_k, top_p, min_p)


@needs_kernel
def test_kernel_on_rows_with_nothing_left():
    logits = torch.full((3, 50), float("-inf"))
    logits[1, 17] = 2.0
    ids = sample_random_rows(logits, torch.ones(3), torch.tensor([0, 5, 3]), torch.tensor([1.0, 0.5, 0.9]),
                             torch.zeros(3), torch.tensor([1, 2, 3]))
    assert ids.tolist() == [0, 17, 0]
