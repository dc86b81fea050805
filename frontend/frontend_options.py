"""Frontend settings `serve` hands on, with vLLM's flag names: CORS
(`--allowed-origins` and friends, JSON lists; every origin by default, as
vLLM, so a browser page may call the API), `--response-role`, logging
(`--enable-log-requests` with `--max-log-len`; uvicorn's access log, on as in
vLLM unless `--disable-uvicorn-access-log`), `--return-tokens-as-token-ids`,
`--disable-playground` (no page at GET /), TLS (`--ssl-keyfile` with
`--ssl-certfile`: HTTPS, and gRPC over TLS on the same key; the frontend's
client of the scheduler's control service then speaks TLS too), and how long
requests wait for a lost scheduler (`--scheduler-restart-timeout`)."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from common.cli_args import env_setting, env_switch, non_negative_int, positive_float
from frontend.lora_modules import add_lora_module_args, lora_modules_argv


DEFAULT_SCHEDULER_RESTART_TIMEOUT = 60.0


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


_SWITCHES = [("--allow-credentials", "ALLOW_CREDENTIALS", "CORS: let those pages send cookies and credentials"),
             ("--enable-log-requests", "ENABLE_LOG_REQUESTS",
              "log each request (its prompt and sampling parameters) and how it ended"),
             ("--disable-uvicorn-access-log", "DISABLE_UVICORN_ACCESS_LOG", "no log line per HTTP request"),
             ("--return-tokens-as-token-ids", "RETURN_TOKENS_AS_TOKEN_IDS",
              'logprobs name tokens "token_id:{id}" unless a request says otherwise'),
             ("--disable-playground", "DISABLE_PLAYGROUND", "no playground page at GET / (it is on by default)")]


def add_frontend_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HTTP API and logging (as vLLM's)")
    for flag, (env, what) in _LIST_FLAGS.items():
        g.add_argument(flag, type=json_string_list, default=env_setting(env, '["*"]'), metavar="JSON_LIST",
                       help=f'CORS: {what}, a JSON list (default ["*"]; env PAGEDSERVE_{env})')
    g.add_argument("--response-role", default=env_setting("RESPONSE_ROLE", "assistant"),
                   help="the role of chat replies that open a new turn (default assistant; env "
                        "PAGEDSERVE_RESPONSE_ROLE)")
    for flag, env, what in _SWITCHES:
        g.add_argument(flag, action="store_true", default=env_switch(env), help=f"{what} (env PAGEDSERVE_{env})")
    g.add_argument("--max-log-len", type=non_negative_int, default=env_setting("MAX_LOG_LEN", None),
                   help="with --enable-log-requests: log at most this many prompt tokens (default: all)")
    g.add_argument("--scheduler-restart-timeout", type=positive_float,
                   default=env_setting("SCHEDULER_RESTART_TIMEOUT", DEFAULT_SCHEDULER_RESTART_TIMEOUT),
                   metavar="SECONDS",
                   help="how long requests wait for a lost scheduler to come back (in-flight ones are then "
                        "resubmitted with the tokens they had) before failing with 503; new requests wait as "
                        "long, or --request-timeout if shorter (default %(default)s; env "
                        "PAGEDSERVE_SCHEDULER_RESTART_TIMEOUT)")
    g.add_argument("--ssl-keyfile", default=env_setting("SSL_KEYFILE", None), metavar="FILE",
                   help="serve HTTPS and gRPC over TLS with this private key (PEM; with --ssl-certfile)")
    g.add_argument("--ssl-certfile", default=env_setting("SSL_CERTFILE", None), metavar="FILE",
                   help="the certificate (chain) of --ssl-keyfile (PEM)")
    add_lora_module_args(g)


def frontend_options_argv(args: argparse.Namespace) -> list[str]:
    """The flags that pass `args`' frontend settings on to a frontend."""
    argv = [item for flag in _LIST_FLAGS
            for item in (flag, json.dumps(getattr(args, flag[2:].replace("-", "_"))))]
    argv += [flag for flag, _, _ in _SWITCHES if getattr(args, flag[2:].replace("-", "_"))]
    argv += ["--response-role", args.response_role] + tls_files_argv(args)
    argv += ["--scheduler-restart-timeout", str(args.scheduler_restart_timeout)] + lora_modules_argv(args)
    return argv + ([] if args.max_log_len is None else ["--max-log-len", str(args.max_log_len)])


def tls_files_argv(args: argparse.Namespace) -> list[str]:
    """--ssl-keyfile/--ssl-certfile as given to `args`, by absolute path: the component
    they are handed to need not share our working directory."""
    return [item for name in ("ssl_keyfile", "ssl_certfile") if getattr(args, name)
            for item in (f"--{name.replace('_', '-')}", os.path.abspath(os.path.expanduser(getattr(args, name))))]
