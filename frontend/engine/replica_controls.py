"""The control services of every data-parallel replica, seen as one (what the
frontend asks of a single `ControlClient`: health, model info, stats).

- health: ready while at least one replica is: its scheduler connected to this
  frontend, answering, and with a worker. The message says how many are.
- model info: the first replica's that answers (every replica serves the same
  model with the same settings).
- stats: summed over the replicas that answer; `stats_by_replica` gives each
  replica's own (None where it does not answer), for per-replica /metrics.
"""
from __future__ import annotations

import asyncio

from common.grpc_gen import control_pb2
from frontend.engine.replica_router import Replica

_SUMMED = ("num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
           "num_prompt_tokens", "num_generation_tokens", "num_free_blocks", "num_blocks",
           "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


class ReplicaControls:
    def __init__(self, replicas: list[Replica]):
        self.replicas = replicas

    @property
    def address(self) -> str:
        return ", ".join(r.control.address for r in self.replicas)

    async def close(self) -> None:
        await asyncio.gather(*(r.control.close() for r in self.replicas))

    async def replica_health(self) -> list[tuple[bool, str]]:
        """(ready, why not) of each replica."""
        replies = await asyncio.gather(*(r.control.health() for r in self.replicas))
        states = []
        for replica, reply in zip(self.replicas, replies):
            if not replica.engine.connected:
                states.append((False, "not connected to its scheduler"))
            elif reply is None:
                states.append((False, "its scheduler's control service does not answer"))
            elif not reply.ok or not reply.worker_ready:
                states.append((False, reply.message or "its scheduler is not ready"))
            else:
                states.append((True, "ready"))
        return states

    async def health(self) -> control_pb2.HealthReply | None:
        states = await self.replica_health()
        ready = sum(ok for ok, _ in states)
        if ready:
            return control_pb2.HealthReply(ok=True, worker_ready=True,
                                           message=f"{ready} of {len(states)} replicas ready")
        return control_pb2.HealthReply(ok=False, worker_ready=False, message="no replica is ready: " + "; ".join(
            f"replica {i}: {why}" for i, (_, why) in enumerate(states)))

    async def is_healthy(self) -> bool:
        return any(ok for ok, _ in await self.replica_health())

    async def model_info(self) -> control_pb2.ModelInfo | None:
        for replica in self.replicas:
            info = await replica.control.model_info()
            if info is not None:
                return info
        return None

    async def stats_by_replica(self) -> list[control_pb2.SchedulerStats | None]:
        return list(await asyncio.gather(*(r.control.stats() for r in self.replicas)))

    async def stats(self) -> control_pb2.SchedulerStats | None:
        return summed_stats(await self.stats_by_replica())


def summed_stats(parts: list[control_pb2.SchedulerStats | None]) -> control_pb2.SchedulerStats | None:
    """One replica-wide view: counts added, KV usage as the share of all blocks in use."""
    known = [p for p in parts if p is not None]
    if not known:
        return None
    total = control_pb2.SchedulerStats(**{name: sum(getattr(p, name) for p in known) for name in _SUMMED})
    positions = max((len(p.spec_decode_num_accepted_tokens_per_pos) for p in known), default=0)
    total.spec_decode_num_accepted_tokens_per_pos.extend(
        sum(p.spec_decode_num_accepted_tokens_per_pos[i] for p in known
            if i < len(p.spec_decode_num_accepted_tokens_per_pos)) for i in range(positions))
    used = sum(p.kv_cache_usage * p.num_blocks for p in known)
    total.kv_cache_usage = used / total.num_blocks if total.num_blocks else (
        sum(p.kv_cache_usage for p in known) / len(known))
    return total
