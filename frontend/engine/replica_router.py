"""Data parallelism in the frontend: one engine client per replica (a scheduler
and its worker group), and a router that picks the replica of each request.

`ReplicaRouter` offers what the frontend asks of a single `EngineClient`
(`generate`, `abort`, `ensure_connected`, `end_all`, ...), so the APIs, beam
search, n > 1 and graceful shutdown use it unchanged. Each request goes to:
- the replica that served the longest prefix of its prompt's blocks
  (`PrefixAffinity`), so that its prefix cache hits, unless that replica's load
  exceeds the least loaded one's by more than `balance_abs` AND by a factor of
  more than `balance_rel` (SGLang's cache-aware router: balance first when the
  replicas are clearly uneven);
- else the least loaded replica (ties in turn). The load is the samples of
  requests this frontend has in flight on the replica.
Replicas whose scheduler is not connected, or that report their waiting queue
full, are skipped while any other can take the request: 503 only when none is
connected, 429 only when every connected one is full. A request that fails
with 503 or 429 before its first output (the replica went down, or filled up,
meanwhile) is sent to the next replica; one that had started fails as with a
single scheduler (503), since its tokens cannot be taken back.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from common.errors import InvalidRequestError
from common.protocol import RequestOutput, parent_request_id
from common.sampling_params import SamplingParams
from frontend.api_errors import OverloadedError, ServiceUnavailableError
from frontend.engine.control_client import ControlClient
from frontend.engine.engine_client import EngineClient
from frontend.engine.prefix_affinity import PrefixAffinity, block_hashes

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16  # until a scheduler says its own
BALANCE_ABS = 4  # requests in flight
BALANCE_REL = 1.5

RouteHook = Callable[[int, str], None]  # (replica, "prefix" | "load")


@dataclass
class Replica:
    index: int
    engine: EngineClient
    control: ControlClient
    load: int = 0  # samples in flight through this frontend
    was_connected: bool = False

    @property
    def takes_requests(self) -> bool:
        return self.engine.connected and not self.engine.queue_full


class ReplicaRouter:
    def __init__(self, replicas: list[tuple[EngineClient, ControlClient]], *, balance_abs: int = BALANCE_ABS,
                 balance_rel: float = BALANCE_REL, affinity_capacity: int | None = None,
                 on_route: RouteHook | None = None):
        if not replicas:
            raise ValueError("at least one replica is required")
        self.replicas = [Replica(i, engine, control) for i, (engine, control) in enumerate(replicas)]
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.affinity = PrefixAffinity(len(self.replicas), *([affinity_capacity] if affinity_capacity else []))
        self.block_size: int | None = None
        self._on_route = on_route
        self._owner: dict[str, Replica] = {}  # request id -> the replica running it
        self._next = 0  # where the next tie among equally loaded replicas starts
        self._closing = False

    # --- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        for replica in self.replicas:
            await replica.engine.start()

    async def close(self) -> None:
        self._closing = True
        await asyncio.gather(*(r.engine.close() for r in self.replicas))

    @property
    def frontend_id(self) -> str:
        return self.replicas[0].engine.frontend_id

    @property
    def scheduler_address(self) -> str:
        return ", ".join(r.engine.scheduler_address for r in self.replicas)

    @property
    def connected(self) -> bool:
        return any(r.engine.connected for r in self.replicas)

    @property
    def num_in_flight(self) -> int:
        return sum(r.engine.num_in_flight for r in self.replicas)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._owner

    # --- choosing -----------------------------------------------------------------
    def choose(self, hashes: list[int], exclude: set[int] = frozenset()) -> tuple[Replica, str]:
        """The replica for a prompt with these block hashes, and why ("prefix" or "load")."""
        candidates = [r for r in self.replicas if r.index not in exclude]
        for replica in candidates:
            if replica.was_connected and not replica.engine.connected:
                self.affinity.forget_replica(replica.index)  # a restarted scheduler has an empty cache
            replica.was_connected = replica.engine.connected
        eligible = ([r for r in candidates if r.takes_requests] or [r for r in candidates if r.engine.connected]
                    or candidates)
        order = len(self.replicas)
        least = min(eligible, key=lambda r: (r.load, (r.index - self._next) % order))
        depths = self.affinity.match_depths(hashes)
        best = max((depths[r.index] for r in eligible), default=0)
        if best > 0:
            holder = min((r for r in eligible if depths[r.index] == best), key=lambda r: r.load)
            if not (holder.load - least.load > self.balance_abs and holder.load > self.balance_rel * least.load):
                return holder, "prefix"
        self._next = (least.index + 1) % order
        return least, "load"

    async def _block_size(self) -> int:
        if self.block_size is None:
            for replica in self.replicas:
                info = await replica.control.model_info()
                if info is not None and info.block_size:
                    self.block_size = info.block_size
                    break
        return self.block_size or DEFAULT_BLOCK_SIZE

    # --- requests -----------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, *,
                       arrival_time: float | None = None, priority: int = 0,
                       cache_salt: str | None = None, pooling_params=None,
                       lora_request=None, images=None) -> AsyncIterator[RequestOutput]:
        """EngineClient.generate on the chosen replica (see the module's docstring)."""
        if request_id in self._owner:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", param="request_id")
        salt = cache_salt if lora_request is None else (cache_salt, lora_request.lora_name)  # (any hashable)
        hashes = block_hashes(prompt_token_ids, await self._block_size(), salt)
        weight = sampling_params.num_samples
        tried: set[int] = set()
        while True:
            replica, reason = self.choose(hashes, tried)
            tried.add(replica.index)
            self._owner[request_id] = replica
            replica.load += weight
            self.affinity.record(hashes, replica.index)  # now: requests right behind it should follow
            if self._on_route is not None:
                self._on_route(replica.index, reason)
            started = False
            try:
                outputs = replica.engine.generate(request_id, prompt_token_ids, sampling_params,
                                                  arrival_time=arrival_time, priority=priority, cache_salt=cache_salt,
                                                  pooling_params=pooling_params, lora_request=lora_request,
                                                  images=images)
                async with aclosing(outputs):
                    async for output in outputs:
                        started = True
                        yield output
                return
            except (ServiceUnavailableError, OverloadedError) as e:
                if started or self._closing or len(tried) == len(self.replicas):
                    raise
                logger.warning("replica %d could not take request %s (%s); trying another", replica.index,
                               request_id, e)
            finally:
                replica.load -= weight
                self._owner.pop(request_id, None)

    def abort(self, request_ids: list[str]) -> None:
        """Abort on the replica running each id (a sample id: its request's); an id not in
        flight here goes to every replica (aborts are idempotent)."""
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            owner = self._owner.get(request_id) or self._owner.get(parent_request_id(request_id))
            for replica in [owner] if owner is not None else self.replicas:
                by_replica.setdefault(replica.index, []).append(request_id)
        for index, ids in by_replica.items():
            self.replicas[index].engine.abort(ids)

    async def ensure_connected(self) -> None:
        """Return if some replica takes new requests; else 503 (none connected) or 429 (all full)."""
        if any(r.takes_requests for r in self.replicas):
            return
        errors = await asyncio.gather(*(r.engine.ensure_connected() for r in self.replicas),
                                      return_exceptions=True)
        if any(e is None for e in errors):
            return
        overloaded = next((e for e in errors if isinstance(e, OverloadedError)), None)
        raise overloaded or ServiceUnavailableError(
            f"no scheduler is reachable (of {len(self.replicas)} replicas: {self.scheduler_address})")

    def end_all(self, error: Exception) -> None:
        self._closing = True
        for replica in self.replicas:
            replica.engine.end_all(error)
