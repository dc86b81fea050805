"""Small HTTP clients for the reliability tests: a streamed completion read to
its end (text, finish reason, error events), many of them at once, and the
scheduler's stats over its control socket."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import grpc
import httpx

from common.grpc_gen import control_pb2, control_pb2_grpc


@dataclass
class StreamResult:
    text: str = ""
    finish_reason: str | None = None
    errors: list[dict] = field(default_factory=list)
    chunks: int = 0
    exception: str | None = None
    status: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.errors and self.exception is None and self.finish_reason is not None


def _read_event(result: StreamResult, line: str) -> None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    event = json.loads(line[6:])
    if "error" in event:
        result.errors.append(event["error"])
        return
    for choice in event.get("choices", []):
        result.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
        result.chunks += 1


def stream_completion(base_url: str, body: dict, *, on_chunk=None, timeout: float = 300) -> StreamResult:
    result = StreamResult()
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json={**body, "stream": True},
                          timeout=timeout) as response:
            result.status = response.status_code
            for line in response.iter_lines():
                _read_event(result, line)
                if on_chunk is not None:
                    on_chunk(result)
    except httpx.HTTPError as e:
        result.exception = repr(e)
    return result


async def _stream_async(client: httpx.AsyncClient, base_url: str, body: dict) -> StreamResult:
    result = StreamResult()
    try:
        async with client.stream("POST", base_url + "/v1/completions", json={**body, "stream": True}) as response:
            result.status = response.status_code
            async for line in response.aiter_lines():
                _read_event(result, line)
    except httpx.HTTPError as e:
        result.exception = repr(e)
    return result


def many_streams(base_url: str, bodies: list[dict], timeout: float = 600) -> list[StreamResult]:
    """All the bodies as concurrent streamed completions, one connection each."""
    async def run() -> list[StreamResult]:
        limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            return await asyncio.gather(*(_stream_async(client, base_url, body) for body in bodies))
    return asyncio.run(run())


def scheduler_stats(control_address: str) -> control_pb2.SchedulerStats:
    with grpc.insecure_channel(control_address) as channel:
        return control_pb2_grpc.SchedulerControlStub(channel).GetStats(control_pb2.Empty(), timeout=5)
