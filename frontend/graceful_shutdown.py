"""How the frontend stops (SIGTERM from ops, `serve`, or `docker compose`).

uvicorn's own shutdown stops accepting connections, waits its grace period,
then cancels whatever still runs: a streaming client sees its connection cut
in the middle of a chunked body, with no error and no `[DONE]`, and the
scheduler keeps generating for nobody until it notices. Here, in order:

1. no new HTTP connections and no new gRPC calls;
2. requests in flight get `DRAIN_S` seconds to finish normally;
3. those still running (or still waiting for the tokenizer pool) then end
   with a 503 "the server is shutting down"
   (an SSE error event and `[DONE]` on a stream, an error body otherwise,
   gRPC UNAVAILABLE), and the scheduler is told to drop them;
4. uvicorn closes the connections, which by then have their last bytes;
5. the caller's cleanup runs and the process exits 0 (uvicorn re-raises the
   SIGTERM it stopped on, which by default would kill the process first).
"""
from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import threading

import uvicorn

from frontend.engine.engine_client import EngineClient
from frontend.api_errors import ServiceUnavailableError
from tokenizer_pool.tokenizer_client import TokenizerClient

logger = logging.getLogger(__name__)

DRAIN_S = 4.0  # requests may finish normally this long after SIGTERM
FLUSH_S = 1.0  # then their error events have this long to reach the clients
SHUTTING_DOWN = "the server is shutting down; send the request again"


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose shutdown also drains the gRPC server and the engine's requests."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, grpc_server, drain_s: float = DRAIN_S,
                 tokenizer_client: TokenizerClient | None = None):
        # uvicorn cancels what still runs after this; by then everything has ended on its own.
        config.timeout_graceful_shutdown = math.ceil(drain_s + FLUSH_S)
        super().__init__(config)
        self.engine = engine
        self.grpc_server = grpc_server
        self.drain_s = drain_s
        self.tokenizer_client = tokenizer_client

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        if threading.current_thread() is not threading.main_thread():
            return await super().serve(sockets)
        previous = signal.signal(signal.SIGTERM, _already_handled)
        try:
            await super().serve(sockets)
        finally:
            signal.signal(signal.SIGTERM, previous)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # grpc's stop refuses new calls at once and waits for the running ones.
        grpc_stopped = asyncio.ensure_future(self.grpc_server.stop(grace=self.drain_s + FLUSH_S))
        ender = asyncio.ensure_future(self._end_requests_after(self.drain_s))
        try:
            await super().shutdown(sockets)
            await grpc_stopped  # gRPC streams may outlast every HTTP connection
        finally:
            ender.cancel()

    async def _end_requests_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.engine.num_in_flight:
            logger.warning("ending %d request(s) still running %.0fs after shutdown began",
                           self.engine.num_in_flight, delay)
            self.engine.end_all(ServiceUnavailableError(SHUTTING_DOWN))
        if self.tokenizer_client is not None:
            # Requests not yet at the engine: waiting for a tokenizer pool that is down.
            self.tokenizer_client.fail_all(ServiceUnavailableError(SHUTTING_DOWN))


def _already_handled(signum: int, frame) -> None:
    """Where uvicorn's re-raised SIGTERM lands: the server has stopped already."""
