"""The Python side of the W8A8 kernels (worker/csrc/int8_linear.cpp): whether they run here,
the fakes compiled graphs trace them with, their entry points, and which batches take the AMX
tiles (`amx_rows`: the tests and benchmarks compare them with the VNNI loop)."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from worker.kernels import cpu_extension

_registered = False
_lock = threading.Lock()


def int8_linear_available() -> bool:
    """Whether the extension is built and this CPU has AVX512-VNNI (registers the fakes once)."""
    global _registered
    module = cpu_extension.load()
    if module is None or not bool(module.int8_linear_available()):
        return False
    with _lock:
        if not _registered:
            torch.library.register_fake("pagedserve::int8_linear")(_linear_shape)
            torch.library.register_fake("pagedserve::int8_linear_silu")(_linear_shape)
            torch.library.register_fake("pagedserve::int8_quantize_rows")(_quantize_shapes)
            _registered = True
    return True


def int8_amx_available() -> bool:
    """Whether batches multiply on AMX-INT8 tiles here (the build has them, the OS grants them)."""
    return int8_linear_available() and bool(cpu_extension.require().int8_amx_available())


@contextlib.contextmanager
def amx_rows(rows: int) -> Iterator[None]:
    """While inside: batches of `rows` rows or more take the AMX tiles (where they run), fewer the
    VNNI loop; a huge `rows` keeps every batch on VNNI. Process-wide: for tests and benchmarks."""
    module = cpu_extension.require()
    previous = module.set_int8_amx_rows(rows)
    try:
        yield
    finally:
        module.set_int8_amx_rows(previous)


def _linear_shape(x: torch.Tensor, packed: torch.Tensor, col_scale: torch.Tensor, col_sum: torch.Tensor,
                  out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def _quantize_shapes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(x.shape[:-1], dtype=torch.float32),
            x.new_empty(x.shape[:-1], dtype=torch.int32))


def int8_linear(x: torch.Tensor, packed: torch.Tensor, col_scale: torch.Tensor, col_sum: torch.Tensor,
                out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] (float32/bfloat16) W8A8 through int8 panels [ceil(N/16), ceil(K/4), 16, 4] with
    the weight's scales [N] and column sums [N] (int32, for the activations' zero points) -> [..., N]."""
    return torch.ops.pagedserve.int8_linear(x, packed, col_scale, col_sum, out_features, bias)


def int8_linear_silu(x: torch.Tensor, packed: torch.Tensor, col_scale: torch.Tensor, col_sum: torch.Tensor,
                     out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up of a gated int8 packing (scales, column sums and bias [2N], gates first)."""
    return torch.ops.pagedserve.int8_linear_silu(x, packed, col_scale, col_sum, out_features, bias)


def int8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u8 [..., K], scales float32 [...], zero points int32 [...]): the kernel's per-token
    activation quantization (x ~ (u8 - zero) * scale)."""
    return torch.ops.pagedserve.int8_quantize_rows(x)
