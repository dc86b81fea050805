"""`bench chaos`: mixed requests for a fixed time while component processes are SIGKILLed.

First every spec (chaos_workload) runs once without faults: its answer is the
reference. Then, for `duration_s`, `concurrency` clients keep sending specs
drawn at random from the same set while a kill loop SIGKILLs a component
process (chaos_victims: kinds in turn) every `kill_interval` seconds (drawn
uniformly), never before the previous victim was restarted. Afterwards: which
requests failed (and why), which completed ones differ from their reference,
the kills, and whether every KV block came back free. `ok` is false for any
failure, mismatch, KV block still held or victim never restarted.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pagedserve.bench.chaos_stack import ServeStack, kv_blocks_at_end
from pagedserve.bench.chaos_victims import VictimChooser, component_pids, recovered
from pagedserve.bench.chaos_workload import Outcome, RequestSpec, compare, outcome_from_json, outcome_from_sse


@dataclass
class ChaosSettings:
    duration_s: float = 600.0
    concurrency: int = 8
    kill_interval: tuple[float, float] = (20.0, 40.0)
    kinds: list[str] = field(default_factory=lambda: ["worker", "scheduler", "tokenizer", "router"])
    seed: int = 0
    request_timeout_s: float = 600.0
    recover_timeout_s: float = 180.0  # a victim not restarted by then stops the kills (and fails the run)
    drain_wait_s: float = 60.0  # how long the KV blocks may take to come back at the end
    max_kills: int | None = None  # stop killing after this many (the load goes on)


async def send(client: Any, base_url: str, model: str, spec: RequestSpec) -> Outcome:
    """One request to its end; any error (HTTP status, error event, connection) is the outcome's error."""
    url = base_url + spec.path
    body = spec.body(model)
    try:
        if spec.stream:
            async with client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    return Outcome(error=f"HTTP {response.status_code}: {text[:500]}")
                lines = [line async for line in response.aiter_lines()]
            return outcome_from_sse(lines, spec.n)
        response = await client.post(url, json=body)
        if response.status_code != 200:
            return Outcome(error=f"HTTP {response.status_code}: {response.text[:500]}")
        return outcome_from_json(response.json(), spec.n)
    except Exception as e:  # a failed request is recorded, not fatal
        return Outcome(error=f"{type(e).__name__}: {e}"[:500])


class ChaosRun:
    def __init__(self, stack: ServeStack, specs: list[RequestSpec], settings: ChaosSettings, log=print):
        self.stack, self.specs, self.settings, self.log = stack, specs, settings, log
        self.rng = random.Random(settings.seed)  # which spec each client sends next
        self.kill_rng = random.Random(settings.seed + 1)  # when and whom to kill
        self.references: dict[str, Outcome] = {}
        self.records: list[dict[str, Any]] = []  # one per request under chaos
        self.kills: list[dict[str, Any]] = []
        self.problems: list[str] = []
        self.in_flight = 0
        self.t0 = 0.0

    def _now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    async def run(self) -> dict[str, Any]:
        import httpx

        limits = httpx.Limits(max_connections=self.settings.concurrency + 4, max_keepalive_connections=0)
        headers = {"Authorization": f"Bearer {self.stack.api_key}"} if self.stack.api_key else None
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.settings.request_timeout_s, connect=30.0),
                                     limits=limits, headers=headers) as client:
            model = (await client.get(self.stack.base_url + "/v1/models")).json()["data"][0]["id"]
            await self._references(client, model)
            self.log(f"[bench chaos] references recorded for {len(self.specs)} specs; chaos for "
                     f"{self.settings.duration_s:g}s, kinds {','.join(self.settings.kinds)}")
            self.t0 = time.monotonic()
            stop_at = self.t0 + self.settings.duration_s
            killer = asyncio.create_task(self._kill_loop(stop_at))
            await asyncio.gather(*(self._client_loop(client, model, stop_at) for _ in range(self.settings.concurrency)))
            elapsed = time.monotonic() - self.t0
            try:  # a kill just before the end: let it see its victim replaced (or time out)
                await asyncio.wait_for(killer, self.settings.recover_timeout_s + 5)
            except TimeoutError:
                self.problems.append("the kill loop did not end")
        self.log("[bench chaos] load finished; waiting for the KV blocks")
        blocks = await asyncio.to_thread(kv_blocks_at_end, self.stack.control_address, self.settings.drain_wait_s,
                                         self.stack.api_key)
        return self._report(elapsed, blocks)

    async def _references(self, client: Any, model: str) -> None:
        gate = asyncio.Semaphore(self.settings.concurrency)

        async def one(spec: RequestSpec) -> None:
            async with gate:
                self.references[spec.name] = await send(client, self.stack.base_url, model, spec)

        await asyncio.gather(*(one(spec) for spec in self.specs))
        failed = {name: o.error for name, o in self.references.items() if not o.ok}
        if failed:
            raise RuntimeError(f"the fault-free run failed {len(failed)} request(s): {failed}")

    async def _client_loop(self, client: Any, model: str, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            spec = self.rng.choice(self.specs)
            started = self._now()
            self.in_flight += 1
            try:
                outcome = await send(client, self.stack.base_url, model, spec)
            finally:
                self.in_flight -= 1
            record: dict[str, Any] = {"spec": spec.name, "sampling": spec.sampling, "stream": spec.stream,
                                      "api": spec.api, "started_s": started, "ended_s": self._now()}
            if outcome.ok:
                record["mismatch"] = compare(spec, self.references[spec.name], outcome)
            else:
                record["error"] = outcome.error
                self.log(f"[bench chaos] {record['ended_s']:.1f}s {spec.name} failed: {outcome.error}")
            self.records.append(record)

    async def _kill_loop(self, stop_at: float) -> None:
        chooser = VictimChooser(self.settings.kinds, self.kill_rng)
        lo, hi = self.settings.kill_interval
        next_at = time.monotonic() + self.kill_rng.uniform(lo, hi)
        limit = self.settings.max_kills
        while next_at < stop_at and (limit is None or len(self.kills) < limit):
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if self.stack.process is not None and self.stack.process.poll() is not None:
                self.problems.append(f"serve exited with code {self.stack.process.returncode}")
                return
            kill = chooser.choose(component_pids(self.stack.serve_pid))
            if kill is None:
                self.problems.append(f"{self._now()}s: no process of kinds {self.settings.kinds} to kill")
                return
            killed_at = time.monotonic()
            try:
                os.kill(kill.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # gone already: choose again
            record = {"kind": kind_label(kill.kind), "pid": kill.pid, "t_s": self._now(),
                      "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "requests_in_flight": self.in_flight}
            self.kills.append(record)
            self.log(f"[bench chaos] {record['t_s']:.1f}s SIGKILL {record['kind']} (pid {kill.pid}), "
                     f"{self.in_flight} requests in flight")
            while not recovered(kill, component_pids(self.stack.serve_pid)):
                if time.monotonic() - killed_at > self.settings.recover_timeout_s:
                    record["restarted_after_s"] = None
                    self.problems.append(f"{record['kind']} pid {kill.pid} killed at {record['t_s']}s was not "
                                         f"restarted within {self.settings.recover_timeout_s:g}s; kills stopped")
                    return
                await asyncio.sleep(0.2)
            record["restarted_after_s"] = round(time.monotonic() - killed_at, 2)
            next_at = max(killed_at + self.kill_rng.uniform(lo, hi), time.monotonic())

    def _report(self, elapsed: float, blocks: dict[str, Any]) -> dict[str, Any]:
        done = [r for r in self.records if "error" not in r]
        failed = [r for r in self.records if "error" in r]
        mismatches = [{**r["mismatch"], "started_s": r["started_s"]} for r in done if r["mismatch"]]
        per_kind: dict[str, int] = {}
        for kill in self.kills:
            per_kind[kill["kind"]] = per_kind.get(kill["kind"], 0) + 1
        by_sampling = {s: {"completed": sum(r["sampling"] == s for r in done),
                           "identical": sum(r["sampling"] == s and not r["mismatch"] for r in done)}
                       for s in ("greedy", "seeded")}
        ok = not failed and not mismatches and blocks.get("all_free", False) and not self.problems
        return {"ok": ok, "duration_s": round(elapsed, 1), "settings": {
                    **{k: v for k, v in vars(self.settings).items()}, "specs": len(self.specs)},
                "requests": len(self.records), "completed": len(done), "failed": len(failed),
                "failures": [{"spec": r["spec"], "started_s": r["started_s"], "ended_s": r["ended_s"],
                              "error": r["error"]} for r in failed],
                "errors": [{"error": e, "count": c} for e, c in Counter(r["error"] for r in failed).most_common()],
                "identical": len(done) - len(mismatches), "mismatched": len(mismatches), "mismatches": mismatches,
                "by_sampling": by_sampling, "kills": self.kills, "kills_per_kind": per_kind,
                "kv_blocks": blocks, "problems": self.problems,
                "serve_log": str(self.stack.log_path) if self.stack.log_path else None}


def kind_label(kind: str) -> str:
    return {"tokenizer": "tokenizer process", "router": "tokenizer router"}.get(kind, kind)


def format_report(report: dict[str, Any]) -> str:
    blocks = report["kv_blocks"]
    lines = [f"bench chaos: {'OK' if report['ok'] else 'FAILED'} after {report['duration_s']:.0f}s "
             f"({report['settings']['concurrency']} concurrent clients, {report['settings']['specs']} specs)",
             f"  requests    {report['completed']} completed, {report['failed']} failed",
             f"  outputs     {report['identical']} identical to the fault-free run, {report['mismatched']} differ"
             + "".join(f"; {s}: {v['identical']}/{v['completed']}" for s, v in report["by_sampling"].items()),
             "  kills       " + (", ".join(f"{k} x{v}" for k, v in report["kills_per_kind"].items()) or "none"),
             f"  KV blocks   " + (f"{blocks['num_free_blocks']} of {blocks['usable_blocks']} free, "
                                  f"{blocks['num_running']} running, {blocks['num_waiting']} waiting"
                                  if "num_blocks" in blocks else f"unknown ({blocks.get('error')})")]
    for kill in report["kills"]:
        restarted = kill.get("restarted_after_s")
        lines.append(f"    {kill['t_s']:7.1f}s {kill['time']} {kill['kind']:<17} pid {kill['pid']:<7} "
                     f"{kill['requests_in_flight']} in flight, "
                     + (f"restarted after {restarted:.1f}s" if restarted is not None else "NOT restarted"))
    for error in report["errors"][:10]:
        lines.append(f"  failed      {error['count']}x {error['error']}")
    for mismatch in report["mismatches"][:20]:
        lines.append(f"  differs     {mismatch['started_s']:.1f}s {mismatch['spec']} choice {mismatch['choice']}: "
                     f"expected {mismatch['expected']!r}, got {mismatch['got']!r}")
    lines += [f"  problem     {p}" for p in report["problems"]]
    return "\n".join(lines)
