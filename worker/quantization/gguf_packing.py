"""GGUF quantized tensors repacked for `pagedserve::gguf_linear` (worker/csrc/gguf_blocks.h).

A tensor's blocks are read as (q, scale, offset): the unsigned quantized values [N, K] and, per
row and chunk of G K values, the float32 scale and offset with weight = scale * q + offset, the
value `gguf.quants.dequantize` computes (scale * q is exact in float32 for every type here). They
are then packed into panels of 16 rows, [ceil(N / 16), K / G, chunk bytes]: the chunk's 16 scales
and 16 offsets (float16 when all of the tensor's are float16 values, as Q4_0's, Q4_1's and Q8_0's
are: fewer bytes to read; else float32), then the values by pairs of K (4 bits: two to a byte; Q6_K: those 4 bits and a
plane of the 2 high bits; Q8_0: a byte each; 8-bit chunks of 16 and 6-bit chunks padded). Parts of a fused weight of different types share
the widest layout (4-bit values fit the 6- and 8-bit ones unchanged).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from worker.models.packed_linear import GATED_BLOCK

PANEL = 16
# The types multiplied quantized: their values' bits and the K values of one scale.
QUANTIZED_TYPES = {T.Q8_0: (8, 32), T.Q4_0: (4, 32), T.Q4_1: (4, 32), T.Q4_K: (4, 32), T.Q6_K: (6, 16)}


@dataclass
class QuantRows:
    """Rows of a quantized weight: q [N, K] uint8, scale and offset [N, K / group] float32."""
    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    bits: int
    group: int

    def permute_rows(self, fn) -> "QuantRows":
        return QuantRows(fn(self.q), fn(self.scale), fn(self.offset), self.bits, self.group)

    def regrouped(self, group: int) -> "QuantRows":
        """The same weights with a scale per `group` K values (at most the type's own group)."""
        repeat = self.group // group
        return QuantRows(self.q, np.repeat(self.scale, repeat, axis=1), np.repeat(self.offset, repeat, axis=1),
                         self.bits, group)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, per: int) -> np.ndarray:
    """Blocks of `per` bytes of two 4-bit values: the low nibbles' values first, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(qs.shape[0], -1, 2 * per)


def unpack_tensor(data: np.ndarray, qtype: int, rows: int, cols: int) -> QuantRows:
    """The (q, scale, offset) of a GGUF tensor's raw blocks `data` ([rows, bytes per row] uint8),
    following gguf.quants' dequantize_blocks of each type."""
    qtype = T(qtype)
    bits, group = QUANTIZED_TYPES[qtype]
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1)
    if qtype == T.Q8_0:  # d * q, q int8: (q + 128) d - 128 d
        b = raw.reshape(-1, 34)
        d = _f16(b[:, :2]).reshape(rows, -1)
        q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return QuantRows(q.reshape(rows, cols), d, -128 * d, bits, group)
    if qtype in (T.Q4_0, T.Q4_1):
        size = 18 if qtype == T.Q4_0 else 20
        b = raw.reshape(-1, size)
        d = _f16(b[:, :2]).reshape(rows, -1)
        offset = -8 * d if qtype == T.Q4_0 else _f16(b[:, 2:4]).reshape(rows, -1)
        q = _nibbles(b[:, size - 16:], 16)
        return QuantRows(q.reshape(rows, cols), d, offset, bits, group)
    if qtype == T.Q4_K:  # d * sc * q - dmin * m over 8 sub-blocks of 32
        from gguf.quants import Q4_K
        b = raw.reshape(-1, 144)
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mins = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
        scale = (d * sc.astype(np.float32)).reshape(rows, -1)
        offset = -(dmin * mins.astype(np.float32)).reshape(rows, -1)
        q = _nibbles(b[:, 16:].reshape(-1, 4, 32), 32)  # 4 x 32 bytes: sub-blocks 2i (low), 2i + 1 (high)
        return QuantRows(q.reshape(rows, cols), scale, offset, bits, group)
    # Q6_K: d * scale[16] * (q - 32), q = ql | qh << 4 as gguf.quants.Q6_K orders them
    b = raw.reshape(-1, 210)
    n = b.shape[0]
    ql = b[:, :128].reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, -1, 32)
    qh = b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(n, -1, 32)
    q = (ql | (qh << 4)).reshape(rows, cols)
    scale = (_f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)).reshape(rows, -1)
    return QuantRows(q, scale, -32 * scale, bits, group)


def concat_rows(parts: list[QuantRows]) -> QuantRows:
    """Parts stacked by rows, in the widest layout any of them needs."""
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    parts = [p.regrouped(group) for p in parts]
    return QuantRows(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]),
                     np.concatenate([p.offset for p in parts]), bits, group)


def half_header(rows: QuantRows) -> bool:
    """Whether the chunks' scales and offsets are stored as float16: every one is a float16 value
    (the weights stay bit for bit gguf's), in chunks of 32 (the layouts gguf_blocks.h has)."""
    if rows.group != 32 or rows.bits == 6:
        return False
    header = np.concatenate([rows.scale.ravel(), rows.offset.ravel()]).astype(np.float32)
    with np.errstate(over="ignore"):
        return bool(np.array_equal(header.astype(np.float16).astype(np.float32), header))


def pack(rows: QuantRows) -> torch.Tensor:
    """The panels [ceil(N / 16), K / G, chunk bytes] uint8 of gguf_blocks.h."""
    n, k = rows.q.shape
    g, pad = rows.group, -n % PANEL
    q = np.pad(rows.q, ((0, pad), (0, 0)))
    float_type = np.float16 if half_header(rows) else np.float32
    scale = np.pad(rows.scale, ((0, pad), (0, 0))).astype(float_type)
    offset = np.pad(rows.offset, ((0, pad), (0, 0))).astype(float_type)
    panels, chunks = (n + pad) // PANEL, k // g
    header = [x.reshape(panels, PANEL, chunks).transpose(0, 2, 1).copy().view(np.uint8) for x in (scale, offset)]
    # [panel, chunk, pair, k in pair, row]
    q = q.reshape(panels, PANEL, chunks, g // 2, 2).transpose(0, 2, 3, 4, 1)
    if rows.bits == 8:
        values = [q.reshape(panels, chunks, -1)]
    else:
        low = q & 0x0F
        values = [(low[..., 0, :] | (low[..., 1, :] << 4)).reshape(panels, chunks, -1)]
        if rows.bits == 6:
            high = (q >> 4).reshape(panels, chunks, g // 4, 2, 2, PANEL)  # [.., pair pair, pair, k, row]
            shifts = np.array([[0, 2], [4, 6]], dtype=np.uint8).reshape(1, 1, 1, 2, 2, 1)
            values.append(np.bitwise_or.reduce((high << shifts).reshape(panels, chunks, g // 4, 4, PANEL), axis=3)
                          .reshape(panels, chunks, -1))
    if rows.bits == 8 and g == 16 or rows.bits == 6:  # padded: a chunk's size names its layout (gguf_blocks.h)
        values.append(np.zeros((panels, chunks, 64 if rows.bits == 8 else 16), dtype=np.uint8))
    packed = np.concatenate([h.reshape(panels, chunks, -1) for h in header] + values, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(packed))


def pack_gated_rows(gate: QuantRows, up: QuantRows) -> torch.Tensor:
    """A fused gate/up weight's panels as packed_linear.pack_gated orders them: blocks of
    GATED_BLOCK gate panels, each followed by the up panels of the same columns."""
    both = concat_rows([gate, up])  # one layout for both
    n = gate.q.shape[0]
    g_rows = QuantRows(both.q[:n], both.scale[:n], both.offset[:n], both.bits, both.group)
    u_rows = QuantRows(both.q[n:], both.scale[n:], both.offset[n:], both.bits, both.group)
    g_packed, u_packed = pack(g_rows), pack(u_rows)
    blocks = []
    for first in range(0, g_packed.shape[0], GATED_BLOCK):
        blocks += [g_packed[first:first + GATED_BLOCK], u_packed[first:first + GATED_BLOCK]]
    return torch.cat(blocks).contiguous()
