"""`pagedserve bench chaos`: its flags, and the command (the run itself is pagedserve.bench.chaos).

    pagedserve bench chaos --duration 600 --enforce-eager --kv-cache-memory 512MiB --output chaos.json

starts a `pagedserve serve` with the engine flags given (float32 unless
--dtype says otherwise), or uses a running one (--url, --serve-pid,
--control-address), and exits 1 unless every request succeeded with the
fault-free output and every KV block was free at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from common.cli_args import add_engine_args, engine_argv, engine_config_from_args
from pagedserve.bench.chaos_victims import KIND_HELP, KINDS


def _interval(text: str) -> tuple[float, float]:
    lo, _, hi = text.replace("-", ",").partition(",")
    try:
        low, high = float(lo), float(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH seconds, got {text!r}") from None
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"need 0 < LOW <= HIGH, got {text!r}")
    return low, high


def cmd_chaos(args: argparse.Namespace) -> int:
    from pagedserve.bench.chaos import ChaosRun, ChaosSettings, format_report
    from pagedserve.bench.chaos_stack import ServeStack
    from pagedserve.bench.chaos_workload import build_specs

    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        print(f"pagedserve bench chaos: error: --kinds must be among {','.join(KINDS)}", file=sys.stderr)
        return 2
    if args.url and (args.serve_pid is None or not args.control_address):
        print("pagedserve bench chaos: error: --url needs --serve-pid and --control-address", file=sys.stderr)
        return 2
    settings = ChaosSettings(duration_s=args.duration, concurrency=args.concurrency, kill_interval=args.kill_interval,
                             kinds=kinds, seed=args.chaos_seed, request_timeout_s=args.client_timeout,
                             recover_timeout_s=args.recover_timeout, drain_wait_s=args.drain_wait,
                             max_kills=args.max_kills)
    specs = build_specs(args.chaos_seed, copies=args.spec_copies, max_tokens=args.max_tokens_range)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.url:
        stack = ServeStack(args.url.rstrip("/"), args.serve_pid, args.control_address, api_key=args.api_key)
    else:
        work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="pagedserve-chaos-"))
        work_dir.mkdir(parents=True, exist_ok=True)
        serve_args = [*engine_argv(engine_config_from_args(args)), "--disable-log-stats", *args.serve_arg]
        log(f"[bench chaos] starting pagedserve serve (log {work_dir / 'serve.log'})")
        stack = ServeStack.start(work_dir, serve_args, args.ready_timeout, api_key=args.api_key)
    try:
        report = asyncio.run(ChaosRun(stack, specs, settings, log=log).run())
    finally:
        stack.stop()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report) if args.json else format_report(report), flush=True)
    return 0 if report["ok"] else 1


def add_chaos_parser(sub) -> None:
    p = sub.add_parser("chaos", help="mixed requests while component processes are SIGKILLed at random moments; "
                       "exits 1 on any failed request, output unlike the fault-free run's, or KV block still held")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of requests under faults (default 600)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at any time (default 8)")
    p.add_argument("--kill-interval", type=_interval, default=(20.0, 40.0), metavar="LOW,HIGH",
                   help="seconds between kills, drawn uniformly (default 20,40); never before the last "
                        "victim was restarted")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"what to kill, in turn (default all: "
                   f"{','.join(KINDS)}). {KIND_HELP}")
    p.add_argument("--max-kills", type=int, default=None,
                   help="stop killing after this many kills (e.g. one of each kind); the load goes on")
    p.add_argument("--chaos-seed", type=int, default=0, help="seed of the specs, their order and the kills")
    p.add_argument("--spec-copies", type=int, default=1, help="specs of each of the 16 kinds (default 1)")
    p.add_argument("--max-tokens-range", type=lambda t: tuple(int(v) for v in _interval(t)), default=(16, 48),
                   metavar="LOW,HIGH", help="max_tokens of the specs, drawn uniformly (default 16,48)")
    p.add_argument("--output", default=None, help="write the report as JSON here")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    p.add_argument("--client-timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--recover-timeout", type=float, default=180.0,
                   help="a victim not restarted after this many seconds stops the kills and fails the run")
    p.add_argument("--drain-wait", type=float, default=60.0,
                   help="seconds the KV blocks may take to be free at the end (default 60)")
    p.add_argument("--work-dir", default=None, help="serve's log and runtime directory (default: a new temp dir)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                   help="another flag for `pagedserve serve` (repeat; e.g. --serve-arg=--request-timeout=300)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds serve may take to be ready")
    p.add_argument("--url", default=None, help="use this running serve instead of starting one (with --serve-pid "
                   "and --control-address)")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="the API key: sent with every request and control call, and given to the serve started "
                        "here (env PAGEDSERVE_API_KEY)")
    p.add_argument("--serve-pid", type=int, default=None, help="with --url: the pid of its `pagedserve: serve`")
    p.add_argument("--control-address", default=None,
                   help="with --url: its scheduler's control socket, e.g. unix:RUNTIME_DIR/control")
    add_engine_args(p)
    # Exact comparison: in bfloat16 a restarted worker's recompute may settle a near tie of two
    # logits the other way (docs/operations.md, Worker crash); float32 unless asked otherwise.
    p.set_defaults(handler=cmd_chaos, dtype=os.environ.get("PAGEDSERVE_DTYPE", "float32"))
