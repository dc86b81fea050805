"""`pagedserve bench perplexity`: one engine in this process, or several variants side by side.

    pagedserve bench perplexity --dtype bfloat16
    pagedserve bench perplexity --variant bf16="--dtype bfloat16 --quantization none" \\
        --variant int8="--dtype bfloat16 --quantization int8" --tolerance int8=2%

Each variant runs `bench perplexity` with the command's engine flags followed
by its own (the later flag wins) in a fresh process; the first is the
reference of the ratios. The exit status is 1 when a variant is out of its
tolerance.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from common.cli_args import add_engine_args, engine_argv, engine_config, engine_config_from_args
from common.errors import ConfigError
from pagedserve.bench.perplexity import (DEFAULT_TEXT, compare_variants, format_single, format_variants,
                                         parse_tolerance, parse_variant, run_perplexity)


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # noqa: D102 - a variant's bad flags become a ValueError, not an exit
        raise ValueError(message)


def _check_engine_flags(name: str, argv: list[str]) -> None:
    parser = add_engine_args(_RaisingParser(add_help=False))
    try:
        engine_config(parser.parse_args(argv))
    except (ValueError, ConfigError) as exc:
        raise ValueError(f"variant {name!r}: {exc}") from None


def _measure_flags(args: argparse.Namespace) -> list[str]:
    argv = ["--text", args.text]
    for flag, value in (("--window", args.window), ("--stride", args.stride),
                        ("--max-text-tokens", args.max_text_tokens)):
        if value:
            argv += [flag, str(value)]
    return argv


def _run_variants(args: argparse.Namespace) -> int:
    from pagedserve.bench.compare import run_json_command

    try:
        variants = [parse_variant(v) for v in args.variant]
        names = [name for name, _ in variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names must differ: {names}")
        tolerances: dict[str, float] = {}
        for item in args.tolerance or []:
            name, sep, value = item.partition("=")
            if not sep or name not in names:
                raise ValueError(f"--tolerance {item!r}: expected NAME=VALUE for a variant's NAME ({', '.join(names)})")
            tolerances[name] = parse_tolerance(value)
        base = engine_argv(engine_config_from_args(args))
        for name, flags in variants:  # every variant's flags checked before the first one runs
            _check_engine_flags(name, base + flags)
    except ValueError as exc:
        print(f"pagedserve bench perplexity: error: {exc}", file=sys.stderr)
        return 2
    results = []
    for name, flags in variants:
        print(f"[bench perplexity] running {name}...", file=sys.stderr, flush=True)
        argv = [sys.executable, "-m", "pagedserve.cli", "bench", "perplexity", "--json", *_measure_flags(args),
                *base, *flags]
        result = run_json_command(argv, f"variant {name}")
        results.append({"variant": name, "flags": flags, **result})
    report = compare_variants(results, tolerances)
    print(json.dumps(report) if args.json else format_variants(report), flush=True)
    return 0 if report["passed"] else 1


def cmd_perplexity(args: argparse.Namespace) -> int:
    if args.variant:
        return _run_variants(args)
    if args.tolerance:
        print("pagedserve bench perplexity: error: --tolerance applies to --variant runs", file=sys.stderr)
        return 2
    config = engine_config_from_args(args)
    try:
        result = run_perplexity(config, args.text, window=args.window, stride=args.stride,
                                max_text_tokens=args.max_text_tokens)
    except (ValueError, OSError) as exc:
        print(f"pagedserve bench perplexity: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_single(result), flush=True)
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_perplexity_parser(sub: Any) -> None:
    p = sub.add_parser("perplexity", help="perplexity of an English text through the engine; "
                       "--variant runs several configurations side by side",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", default=str(DEFAULT_TEXT),
                   help="UTF-8 text file (default: chapters 1-2 of Austen's Persuasion, shipped)")
    p.add_argument("--window", type=_positive, default=None,
                   help="tokens per window (default: the model's context less one)")
    p.add_argument("--stride", type=_positive, default=None, help="tokens between window starts (default: half "
                   "the window); each scored token has at least window - stride tokens of context")
    p.add_argument("--max-text-tokens", type=_positive, default=None, help="score only the first N tokens")
    p.add_argument("--variant", action="append", default=[], metavar='NAME="FLAGS"',
                   help="a configuration: engine flags added after this command's (repeat; the first is the "
                        "reference of the ratios)")
    p.add_argument("--tolerance", action="append", metavar="NAME=VALUE",
                   help="largest |perplexity ratio - 1| for variant NAME, e.g. int8=2%% or int8=0.02")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    add_engine_args(p)
    p.set_defaults(handler=cmd_perplexity)
