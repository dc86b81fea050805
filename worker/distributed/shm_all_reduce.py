"""All-reduce through shared memory for the tensor-parallel ranks of one host.

gloo's all-reduce goes through TCP sockets: about 0.3 ms per call on a small
machine, paid twice per layer per step. Ranks on one host can instead meet in
a shared memory segment: each writes its partial sum into its own slot,
publishes a sequence number, waits for every peer's, and adds the slots up in
rank order (the same order on every rank, so every rank gets the same bits).

Two alternating buffers make it safe without a second barrier: a rank writes
buffer k % 2 for call k only after every peer published call k - 1, which a
peer does only after it has finished reading call k - 2 (the same buffer).
x86 keeps stores in order, so a peer that sees the sequence number sees the
data written before it. A waiting rank spins on its own core; it yields the
core between checks once it has waited a while (ranks sharing cores), and it
raises when a peer process is gone, so the group restarts as with gloo.
"""
from __future__ import annotations

import os
import secrets
import time
from multiprocessing import resource_tracker, shared_memory

import torch
import torch.distributed as dist

SLOT_BYTES = 8 << 20  # per rank and buffer: a [T, hidden] partial of up to 8 MiB (larger: gloo)
HEADER = 64  # one int64 sequence number a rank, on its own cache line
SPIN_BEFORE_YIELD = 2000
CHECK_PEERS_EVERY_S = 0.5


def process_alive(pid: int) -> bool:
    """Whether `pid` runs: not gone, and not a zombie (a dead child of ours not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


class ShmAllReduce:
    def __init__(self, group: dist.ProcessGroup | None, ranks: list[int], my_index: int):
        """Collective over `group` (whose global ranks are `ranks`); call on every rank of it."""
        self.size, self.index = len(ranks), my_index
        name = torch.zeros(1, dtype=torch.int64)
        if my_index == 0:
            name[0] = secrets.randbits(62)
        dist.broadcast(name, src=ranks[0], group=group)
        self.name = f"pagedserve-tp-{int(name.item()):x}"
        total = HEADER * self.size + 2 * self.size * SLOT_BYTES
        if my_index == 0:
            self.shm = shared_memory.SharedMemory(self.name, create=True, size=total)
        dist.barrier(group=group)
        if my_index != 0:
            self.shm = shared_memory.SharedMemory(self.name)
            # Python < 3.13 registers an attached segment for removal at exit too: it is unlinked once, below.
            resource_tracker.unregister(self.shm._name, "shared_memory")
        pids = torch.zeros(self.size, dtype=torch.int64)
        pids[my_index] = os.getpid()
        dist.all_reduce(pids, group=group)  # everyone attached: the name can go
        if my_index == 0:
            self.shm.unlink()
        self.peer_pids = [int(p) for i, p in enumerate(pids.tolist()) if i != my_index]
        buffer = self.shm.buf
        self.sequence = torch.frombuffer(buffer, dtype=torch.int64, count=HEADER // 8 * self.size).view(self.size, -1)
        self.data = torch.frombuffer(buffer, dtype=torch.uint8, offset=HEADER * self.size)
        self.calls = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.numel() * x.element_size() <= SLOT_BYTES

    def _slot(self, buffer: int, rank_index: int, like: torch.Tensor) -> torch.Tensor:
        start = (buffer * self.size + rank_index) * SLOT_BYTES
        raw = self.data[start:start + like.numel() * like.element_size()]
        return raw.view(like.dtype).view(like.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        buffer = self.calls % 2
        self._slot(buffer, self.index, x).copy_(x)
        self.sequence[self.index, 0] = self.calls  # after the data: peers that see it see the data
        self._wait_for_peers()
        out = self._slot(buffer, 0, x).clone()
        for rank_index in range(1, self.size):
            out += self._slot(buffer, rank_index, x)
        return out

    def _wait_for_peers(self) -> None:
        spins, checked = 0, time.monotonic()
        column = self.sequence[:, 0]
        while int(column.min()) < self.calls:
            spins += 1
            if spins > SPIN_BEFORE_YIELD:
                os.sched_yield()
                now = time.monotonic()
                if now - checked > CHECK_PEERS_EVERY_S:
                    checked = now
                    self._check_peers()

    def _check_peers(self) -> None:
        for pid in self.peer_pids:
            if not process_alive(pid):
                raise RuntimeError(f"tensor-parallel peer process {pid} is gone (shared-memory all-reduce)")

    def close(self) -> None:
        del self.sequence, self.data
        self.shm.close()
