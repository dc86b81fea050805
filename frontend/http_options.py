"""HTTP settings `serve` hands on to the frontend, with vLLM's flag names:
CORS (`--allowed-origins` and friends, JSON lists; every origin by default, as
vLLM, so a browser page may call the API) and `--response-role`."""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from common.cli_args import env_default


def json_string_list(text: str) -> list[str]:
    """'["http://a.example", "http://b.example"]' -> a list (argparse turns the error into a usage line)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f'not a JSON list of strings: {text!r} (e.g. \'["https://example.com"]\')')
    return value


@dataclass(frozen=True, slots=True)
class CorsSettings:
    allowed_origins: list[str]
    allowed_methods: list[str]
    allowed_headers: list[str]
    allow_credentials: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CorsSettings":
        return cls(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)


_LIST_FLAGS = {"--allowed-origins": ("ALLOWED_ORIGINS", "origins a browser may call the API from"),
               "--allowed-methods": ("ALLOWED_METHODS", "HTTP methods those pages may use"),
               "--allowed-headers": ("ALLOWED_HEADERS", "request headers those pages may send")}


def add_http_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HTTP (as vLLM's)")
    for flag, (env, what) in _LIST_FLAGS.items():
        g.add_argument(flag, type=json_string_list, default=env_default(env, '["*"]'), metavar="JSON_LIST",
                       help=f'CORS: {what}, a JSON list (default ["*"]; env PAGEDSERVE_{env})')
    g.add_argument("--allow-credentials", action="store_true",
                   default=env_default("ALLOW_CREDENTIALS", "") not in ("", "0", "false"),
                   help="CORS: let those pages send cookies and credentials (env PAGEDSERVE_ALLOW_CREDENTIALS)")
    g.add_argument("--response-role", default=env_default("RESPONSE_ROLE", "assistant"),
                   help="the role of chat replies that open a new turn (default assistant; env "
                        "PAGEDSERVE_RESPONSE_ROLE)")


def http_options_argv(args: argparse.Namespace) -> list[str]:
    """The flags that pass `args`' HTTP settings on to a frontend."""
    argv = [item for flag in _LIST_FLAGS
            for item in (flag, json.dumps(getattr(args, flag[2:].replace("-", "_"))))]
    return argv + (["--allow-credentials"] if args.allow_credentials else []) + ["--response-role", args.response_role]
