"""`pagedserve` command line: one subcommand per component, plus serve/generate/bench.

Each subcommand's module is imported only when used, so `pagedserve frontend`
never loads torch and `pagedserve --help` is instant.
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module with `main(argv)`, help line)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pagedserve.serve", "start and supervise every component on this host"),
    "generate": ("pagedserve.offline.generate_cli", "generate text offline (no server) and print it"),
    "frontend": ("frontend.frontend_cli", "the OpenAI-compatible HTTP and gRPC API"),
    "tokenizer": ("tokenizer_pool.tokenizer_pool_cli", "the tokenizer pool (router + tokenizer processes)"),
    "scheduler": ("scheduler.scheduler_cli", "the scheduler (KV blocks, batching, prefix cache)"),
    "worker": ("worker.worker_cli", "a model worker for one device"),
    "bench": ("pagedserve.bench.bench_cli", "throughput, serving and comparison benchmarks"),
}


def usage() -> str:
    lines = ["usage: pagedserve <command> [flags]   (pagedserve <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name:<10} {help_line}" for name, (_, help_line) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import version
        print(version("pagedserve"))
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"pagedserve: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
