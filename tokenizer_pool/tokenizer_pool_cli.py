"""`pagedserve tokenizer`: the tokenizer pool.

    pagedserve tokenizer [--tokenizer-pool-size K]      router + K local workers
    pagedserve tokenizer --tokenizer-pool-size 0        router only (remote workers join it)
    pagedserve tokenizer --join tcp://ROUTER:5557 [-K]  K workers for an existing router

The join mode is how the pool scales across containers: one `tokenizer-router`
service runs the router, and `docker compose up --scale tokenizer=3` starts
three more containers of worker processes that join it.
"""
from __future__ import annotations

import argparse
import logging
import sys

import zmq

from common.errors import USAGE_ERROR, ConfigError
from common.addresses import default_address
from common.cli_args import (MODEL_HELP, SettingsParser, add_log_level_arg, add_model_source_args, env_default,
                             env_setting)
from common.logging_setup import setup_logging
from common.media_args import add_allowed_media_domains_arg, add_limit_mm_arg, image_limit
from common.tokenizer import load_chat_template
from tokenizer_pool.image_decoding import ImageLimits
from tokenizer_pool.pool import DEFAULT_LIVENESS_TIMEOUT, run_join_workers, run_tokenizer_pool
from tokenizer_pool.tokenize_worker import DEFAULT_HEARTBEAT_INTERVAL

logger = logging.getLogger(__name__)


def add_chat_template_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--chat-template (`serve` has it too, with the same PAGEDSERVE_CHAT_TEMPLATE default)."""
    parser.add_argument("--chat-template", default=env_setting("CHAT_TEMPLATE", None), metavar="FILE_OR_TEMPLATE",
                        help="a Jinja chat template (its file, or the text) to use instead of the model's "
                             "(env PAGEDSERVE_CHAT_TEMPLATE)")


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("tokenizer pool")
    g.add_argument("--model", default=env_default("MODEL", "smollm2-135m-instruct"),
                   help="whose tokenizer to load: a tokenizer directory or " + MODEL_HELP +
                        " (default: smollm2-135m-instruct)")
    add_model_source_args(g)
    g.add_argument("--tokenizer-pool-size", type=int, default=env_default("TOKENIZER_POOL_SIZE", 2),
                   help="tokenizer worker processes on this host (default 2; 0 = router only)")
    g.add_argument("--frontend-address", default=default_address("TOKENIZER_ADDRESS"),
                   help="where frontends reach the router (env PAGEDSERVE_TOKENIZER_ADDRESS)")
    g.add_argument("--backend-address", default=default_address("TOKENIZER_BACKEND_ADDRESS"),
                   help="where tokenizer workers reach the router (env PAGEDSERVE_TOKENIZER_BACKEND_ADDRESS)")
    g.add_argument("--join", default=env_default("TOKENIZER_JOIN", None), metavar="BACKEND_ADDRESS",
                   help="start only workers, serving the router whose backend is at this address "
                        "(env PAGEDSERVE_TOKENIZER_JOIN)")
    g.add_argument("--model-cache-dir", default=env_default("CACHE_DIR", None),
                   help="where converted GGUF models are kept (default ~/.cache/pagedserve/models)")
    add_chat_template_arg(g)
    add_limit_mm_arg(g)
    add_allowed_media_domains_arg(g)
    g.add_argument("--heartbeat-interval", type=float, default=DEFAULT_HEARTBEAT_INTERVAL,
                   help="seconds between a worker's heartbeats (default %(default)s)")
    g.add_argument("--liveness-timeout", type=float, default=DEFAULT_LIVENESS_TIMEOUT,
                   help="the router drops a worker silent this long and re-dispatches its jobs "
                        "(default %(default)s)")
    add_log_level_arg(g)
    return parser


def run(args: argparse.Namespace) -> int:
    setup_logging("tokenizer", args.log_level)
    from common.model_files import resolve_tokenizer_dir

    try:
        # Resolved once here (a Hub model: its tokenizer files fetched now), so that every
        # tokenizer process loads the same local directory.
        args.model = resolve_tokenizer_dir(args.model, args.model_cache_dir, revision=args.revision,
                                           gguf_file=args.gguf_file)
        images = image_limits(args)
        if args.join:
            run_join_workers(args.model, args.join, args.tokenizer_pool_size, model_cache_dir=args.model_cache_dir,
                             heartbeat_interval=args.heartbeat_interval, log_level=args.log_level,
                             chat_template=args.chat_template, image_limits=images)
        else:
            run_tokenizer_pool(args.model, args.frontend_address, args.backend_address, args.tokenizer_pool_size,
                               model_cache_dir=args.model_cache_dir, heartbeat_interval=args.heartbeat_interval,
                               liveness_timeout=args.liveness_timeout, log_level=args.log_level,
                               chat_template=args.chat_template, image_limits=images)
    except ConfigError as e:  # a model without a usable tokenizer: a usage error, which a restart would repeat
        logger.error("%s", e)
        return USAGE_ERROR
    except zmq.ZMQError as e:  # typically: the address is in use or malformed
        logger.error("cannot start the tokenizer pool: %s", e)
        return 1
    return 0


def image_limits(args: argparse.Namespace) -> ImageLimits:
    """What chat images may be: --limit-mm-per-prompt, --allowed-media-domains."""
    return ImageLimits(max_images=image_limit(args.limit_mm_per_prompt),
                       allowed_domains=tuple(args.allowed_media_domains))


def build_parser() -> SettingsParser:
    parser = SettingsParser(prog="pagedserve tokenizer", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_tokenizer_args(parser)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The settings, checked: what cannot run is a usage error here (also `serve`'s check)."""
    args = parser.parse_args(argv)
    if args.tokenizer_pool_size < 0 or (args.join and args.tokenizer_pool_size == 0):
        parser.error(f"--tokenizer-pool-size must be >= 0 (>= 1 with --join), got {args.tokenizer_pool_size}")
    if args.heartbeat_interval <= 0 or args.liveness_timeout <= args.heartbeat_interval:
        parser.error("need 0 < --heartbeat-interval < --liveness-timeout")
    try:
        load_chat_template(args.chat_template)  # a bad one fails here, not in each tokenizer process
    except ConfigError as e:
        parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(build_parser(), argv))


if __name__ == "__main__":
    sys.exit(main())
