"""Messages from one rank to every rank of the worker group, over torch.distributed.

Rank 0 hands each step plan (and group controls) to the other ranks; with
pipeline parallelism the last stage hands back the step's sampled tokens. A
message travels as its wire encoding (the MessageType byte, then msgpack): a
length, then the bytes, as two broadcasts. Receivers decode only the types they
expect, as on every socket: no pickle.
"""
from __future__ import annotations

from collections.abc import Iterable

import msgspec
import torch
import torch.distributed as dist

from common.protocol import MessageType
from common.transport import MessageDecoder, encode


class GroupChannel:
    def __init__(self, src: int, expected: Iterable[MessageType]):
        self.src = src
        self.decoder = MessageDecoder(expected)

    def send(self, msg: msgspec.Struct) -> None:
        """Called on `src`: every other rank must be in `receive`."""
        type_frame, body = encode(msg)
        data = torch.frombuffer(bytearray(type_frame + body), dtype=torch.uint8)
        dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), src=self.src)
        dist.broadcast(data, src=self.src)

    def receive(self) -> msgspec.Struct:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=self.src)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=self.src)
        raw = data.numpy().tobytes()
        return self.decoder.decode([raw[:1], raw[1:]])
