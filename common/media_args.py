"""The image-input flags, vLLM's names: `--limit-mm-per-prompt '{"image": N}'` (images per
prompt; 1 by default, as vLLM) on the engine commands, the tokenizer pool and the frontend;
`--allowed-media-domains HOST ...` (hosts whose http(s) image URLs the tokenizer pool
fetches; none by default) on the tokenizer pool and `serve`. Both also read PAGEDSERVE_*
variables (compose passes settings that way; read here directly: common.cli_args imports this)."""
from __future__ import annotations

import argparse
import json
import os
import re

DEFAULT_IMAGE_LIMIT = 1  # vLLM's
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$|^\[?[0-9A-Fa-f:.]+\]?$")


def limit_mm_json(text: str) -> dict[str, int]:
    """'{"image": 2}' -> {"image": 2} (argparse turns the error into a usage line)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or any(key != "image" or type(limit) is not int or limit < 0
                                          for key, limit in value.items()):
        raise argparse.ArgumentTypeError(f'not a JSON object {{"image": N}} with N >= 0: {text!r}')
    return value


def image_limit(limit_mm_per_prompt: dict[str, int] | None) -> int:
    """Images allowed in one prompt."""
    return (limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGE_LIMIT)


def media_domain(text: str) -> str:
    host = text.strip().lower()
    if not _HOST.match(host):
        raise argparse.ArgumentTypeError(f"not a host name: {text!r} (e.g. upload.wikimedia.org)")
    return host.strip("[]")


def add_limit_mm_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--limit-mm-per-prompt", type=limit_mm_json, metavar="JSON",
                        default=os.environ.get("PAGEDSERVE_LIMIT_MM_PER_PROMPT") or None,
                        help='vision-language models: the most images one prompt may hold, as vLLM\'s JSON '
                             '\'{"image": N}\' (default 1; env PAGEDSERVE_LIMIT_MM_PER_PROMPT)')


def add_allowed_media_domains_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    env = os.environ.get("PAGEDSERVE_ALLOWED_MEDIA_DOMAINS", "")
    parser.add_argument("--allowed-media-domains", type=media_domain, nargs="+", metavar="HOST",
                        default=[host.lower() for host in env.replace(",", " ").split()],
                        help="fetch http(s) image URLs of these hosts (exact names; default none: only data "
                             "URLs; env PAGEDSERVE_ALLOWED_MEDIA_DOMAINS, comma-separated)")


def media_argv(args: argparse.Namespace, *, domains: bool = True) -> list[str]:
    """The flags that hand `args`' image settings on to a component."""
    argv = [] if args.limit_mm_per_prompt is None else ["--limit-mm-per-prompt",
                                                        json.dumps(args.limit_mm_per_prompt)]
    if domains and args.allowed_media_domains:
        argv += ["--allowed-media-domains", *args.allowed_media_domains]
    return argv
