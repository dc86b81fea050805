"""Serving benchmark: requests with Poisson arrivals, streamed through the OpenAI HTTP API.

Each request is a completion of a token-id prompt (greedy, ignore_eos, exactly
max_tokens tokens) streamed over SSE. Per request it records the time to the
first token (TTFT), the gaps between streamed chunks (inter-token latency,
ITL) and the end-to-end latency (E2E); the report has their mean, p50, p90
and p99 and the overall request and token throughput. `rate=inf` sends every
request at once (saturation).

The named workloads are seeded, so a second run against the same server would
find its prompts in the prefix cache and report a throughput no cold server
reaches: every run sends a fresh `cache_salt` (vLLM's request field, which
starts the prompt's block hashes) unless told to send a given one or none.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.bench.workloads import BenchRequest


@dataclass(slots=True)
class RequestRecord:
    prompt_tokens: int
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of a Poisson process with `rate` requests/s."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


RANDOM_SALT = "random"  # `--cache-salt` value: a fresh salt for each run
NO_SALT = "none"


def run_cache_salt(choice: str) -> str | None:
    """The salt a run sends: a fresh one for `random`, none for `none`, else `choice` itself."""
    if choice == RANDOM_SALT:
        return f"bench-{uuid.uuid4().hex}"
    return None if choice == NO_SALT else choice


async def _one_request(client: Any, url: str, model: str, request: BenchRequest, record: RequestRecord,
                       cache_salt: str | None) -> None:
    body = {"model": model, "prompt": request.prompt_token_ids, "max_tokens": request.max_tokens,
            "min_tokens": request.max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    started = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if event.get("usage"):
                    record.output_tokens = event["usage"].get("completion_tokens", 0)
                if not event.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    record.ttft_s = now - started
                else:
                    record.itl_s.append(now - last)
                last = now
        record.e2e_s = time.perf_counter() - started
        record.ok = last is not None and record.output_tokens == request.max_tokens
        if not record.ok and not record.error:
            record.error = f"got {record.output_tokens} of {request.max_tokens} tokens"
    except Exception as exc:  # a failed request is counted, not fatal
        record.error = f"{type(exc).__name__}: {exc}"


async def run_serving(base_url: str, requests: list[BenchRequest], *, rate: float, model: str | None = None,
                      max_concurrency: int | None = None, seed: int = 0, progress: bool = True,
                      timeout_s: float = 3600.0, cache_salt: str | None = None) -> dict[str, Any]:
    import httpx
    from tqdm.auto import tqdm

    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) + 1,
                          max_keepalive_connections=max_concurrency or len(requests) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        if model is None:
            listing = (await client.get(f"{base_url}/v1/models")).json()
            model = listing["data"][0]["id"]
        records = [RequestRecord(len(r.prompt_token_ids)) for r in requests]
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), desc="Requests", unit="req", disable=not progress, dynamic_ncols=True)
        url = f"{base_url}/v1/completions"

        async def launch(request: BenchRequest, record: RequestRecord, delay: float) -> None:
            await asyncio.sleep(delay)
            if gate is None:
                await _one_request(client, url, model, request, record, cache_salt)
            else:
                async with gate:
                    await _one_request(client, url, model, request, record, cache_salt)
            bar.update(1)

        started = time.perf_counter()
        offsets = arrival_offsets(len(requests), rate, seed)
        await asyncio.gather(*(launch(r, rec, off) for r, rec, off in zip(requests, records, offsets)))
        duration = time.perf_counter() - started
        bar.close()
    return summarize(records, duration, rate=rate, model=model, max_concurrency=max_concurrency,
                     cache_salt=cache_salt)


def summarize(records: list[RequestRecord], duration: float, **settings: Any) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    result: dict[str, Any] = {
        **{k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in settings.items()},
        "completed": len(done), "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": round(duration, 3), "output_tokens": output_tokens,
        "requests_per_s": round(len(done) / duration, 3),
        "output_tokens_per_s": round(output_tokens / duration, 2),
        "total_tokens_per_s": round((output_tokens + prompt_tokens) / duration, 2),
    }
    metrics = {"ttft": [r.ttft_s for r in done], "itl": [g for r in done for g in r.itl_s],
               "e2e": [r.e2e_s for r in done]}
    for name, values in metrics.items():
        for stat, q in (("p50", 50), ("p90", 90), ("p99", 99)):
            result[f"{name}_{stat}_ms"] = round(1000 * percentile(values, q), 2) if values else None
        result[f"{name}_mean_ms"] = round(1000 * sum(values) / len(values), 2) if values else None
    return result


def format_serving(result: dict[str, Any]) -> str:
    rate = result.get("rate")
    lines = [
        f"serving benchmark: {result['completed']} completed, {result['failed']} failed, "
        f"rate {'inf' if rate is None else rate} req/s",
        f"  duration             {result['duration_s']:.2f} s",
        f"  requests/s           {result['requests_per_s']:.2f}",
        f"  output tokens/s      {result['output_tokens_per_s']:.1f}",
        f"  total tokens/s       {result['total_tokens_per_s']:.1f}",
        f"  {'latency (ms)':<20} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}",
    ]
    for name, label in (("ttft", "time to first token"), ("itl", "inter-token"), ("e2e", "end to end")):
        cells = [result.get(f"{name}_{s}_ms") for s in ("mean", "p50", "p90", "p99")]
        lines.append(f"  {label:<20} " + " ".join(f"{c:>9.1f}" if c is not None else f"{'-':>9}" for c in cells))
    if result["errors"]:
        lines.append("  errors: " + "; ".join(result["errors"]))
    return "\n".join(lines)
