"""`pagedserve` command line: one subcommand per component, plus serve/generate/bench.

Each subcommand's module is imported only when used, so `pagedserve frontend`
never loads torch and `pagedserve --help` is instant.
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module with `main(argv)`, help line)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("common.serve", "start and supervise every component on this host"),
    "generate": ("worker.generate_cli", "generate text offline (no server) and print it"),
    "frontend": ("frontend.cli", "the OpenAI-compatible HTTP and gRPC API"),
    "tokenizer": ("tokenizer_pool.cli", "the tokenizer pool (router + tokenizer processes)"),
    "scheduler": ("scheduler.cli", "the scheduler (KV blocks, batching, prefix cache)"),
    "worker": ("worker.cli", "a model worker for one device"),
    "bench": ("common.bench_cli", "throughput, serving and comparison benchmarks"),
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
