"""The Hadamard rotation of queries and keys under an 8-bit KV cache (worker.attention.kv_rotation):
orthogonal, so scores are unchanged; smaller rounding error on keys with outlier channels; only
for 8-bit caches without checkpoint scales."""
from __future__ import annotations

import pytest
import torch

from worker.attention.kv_rotation import hadamard, kv_rotations, rotate


@pytest.mark.parametrize("dim", [16, 64, 96, 128, 256])
def test_rotation_is_orthogonal_and_symmetric(dim):
    h = hadamard(dim, torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(dim, dtype=torch.float64))
    torch.testing.assert_close(h, h.T)
    block = dim & -dim
    torch.testing.assert_close(h[:block, :block].abs(), torch.full((block, block), block ** -0.5, dtype=torch.float64))


def test_scores_are_unchanged():
    torch.manual_seed(0)
    q, k = torch.randn(5, 4, 64), torch.randn(7, 4, 64)
    h = hadamard(64, torch.float32)
    torch.testing.assert_close(torch.einsum("qhd,khd->hqk", rotate(q, h), rotate(k, h)),
                               torch.einsum("qhd,khd->hqk", q, k), atol=1e-5, rtol=1e-5)


def _score_error(q: torch.Tensor, k: torch.Tensor) -> float:
    rounded = k.to(torch.float8_e4m3fn).float()
    return ((q @ rounded.T) - (q @ k.T)).pow(2).mean().sqrt().item()


def test_rotated_keys_lose_less_to_e4m3():
    """Post-rotary-like keys and queries whose size sits in a few shared channels: rounding the
    rotated keys moves the scores several times less than rounding the keys as they are."""
    torch.manual_seed(1)
    q, k = torch.randn(64, 64) * 0.3, torch.randn(256, 64) * 0.3
    q[:, 60:], k[:, 60:] = q[:, 60:] * 30, k[:, 60:] * 30
    h = hadamard(64, torch.float32)
    assert _score_error(rotate(q, h), rotate(k, h)) * 3 < _score_error(q, k)


def _caches(dtype: torch.dtype, dims=(64, 64)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(2, 4, 1, d, dtype=dtype), torch.zeros(2, 4, 1, d, dtype=dtype)) for d in dims]


def test_only_8bit_caches_without_checkpoint_scales_rotate():
    assert kv_rotations(_caches(torch.bfloat16), None) is None
    rotations = kv_rotations(_caches(torch.float8_e4m3fn, (64, 128)), [(1.0, 1.0)] * 2)
    assert sorted(rotations) == [64, 128] and rotations[64].dtype == torch.float32
    assert kv_rotations(_caches(torch.float8_e5m2), None) is not None
    # Checkpoint scales are calibrated to the keys as they are: no rotation then.
    assert kv_rotations(_caches(torch.float8_e4m3fn), [(0.02, 1.0), (1.0, 1.0)]) is None
