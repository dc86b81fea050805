"""`pagedserve scheduler`: the scheduler process (one per model replica)."""
from __future__ import annotations

import argparse
import logging

from common.addresses import default_address
from common.cli_args import (SettingsParser, add_engine_args, add_log_level_arg, engine_config_from_args, env_default,
                             env_setting, non_negative_float, non_negative_int, parse_engine_args, positive_float)
from common.errors import ConfigError
from common.logging_setup import setup_logging
from common.proctitle import set_process_title
from common.signals import on_stop_signals
from common.tls_files import TlsFiles

logger = logging.getLogger(__name__)

DEFAULT_MAX_WAITING_REQUESTS = 4096


def build_parser() -> SettingsParser:
    parser = SettingsParser(prog="pagedserve scheduler", description=__doc__)
    parser.add_argument("--scheduler-address", default=default_address("SCHEDULER_ADDRESS"),
                        help="ZMQ address frontends connect to (bound here)")
    parser.add_argument("--worker-address", default=default_address("WORKER_ADDRESS"),
                        help="ZMQ address workers connect to (bound here)")
    parser.add_argument("--scheduler-control-address", default=default_address("SCHEDULER_CONTROL_ADDRESS"),
                        help="gRPC control service address (bound here)")
    parser.add_argument("--frontend-timeout", type=positive_float, default=5.0,
                        help="abort a frontend's requests after this many seconds without a heartbeat")
    parser.add_argument("--max-waiting-requests", type=non_negative_int,
                        default=env_default("MAX_WAITING_REQUESTS", DEFAULT_MAX_WAITING_REQUESTS),
                        help="refuse new requests (HTTP 429) while this many wait to be scheduled; 0 = no limit "
                             "(default %(default)s; env PAGEDSERVE_MAX_WAITING_REQUESTS)")
    parser.add_argument("--worker-step-timeout", type=non_negative_float,
                        default=env_default("WORKER_STEP_TIMEOUT", 0),
                        help="treat the worker as hung and wait for another one when a step takes longer than "
                             "this many seconds; 0 = never (default; env PAGEDSERVE_WORKER_STEP_TIMEOUT)")
    parser.add_argument("--disable-log-stats", action="store_true")
    add_control_security_args(parser)
    add_log_level_arg(parser)
    return add_engine_args(parser)


def add_control_security_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("control service security (docs/operations.md, Security)")
    g.add_argument("--api-key", default=env_setting("API_KEY", None),
                   help="require 'authorization: Bearer <key>' on every control call but Health (a CURVE "
                        "cluster key, PAGEDSERVE_CURVE_SECRET_KEY, does too, with a token derived from it); "
                        "prefer the env PAGEDSERVE_API_KEY, which `ps` does not show")
    g.add_argument("--ssl-keyfile", default=env_setting("SSL_KEYFILE", None), metavar="FILE",
                   help="serve the control service over TLS only, with this private key (PEM; with "
                        "--ssl-certfile; env PAGEDSERVE_SSL_KEYFILE)")
    g.add_argument("--ssl-certfile", default=env_setting("SSL_CERTFILE", None), metavar="FILE",
                   help="the certificate (chain) of --ssl-keyfile (PEM; env PAGEDSERVE_SSL_CERTFILE); frontends "
                        "given the same files trust it")


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The settings, checked (also `serve`'s check)."""
    args = parse_engine_args(parser, argv)
    try:
        args.tls = TlsFiles.from_args(args)  # a missing or unusable key fails here, not at the bind
    except ConfigError as e:
        parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    setup_logging("scheduler", args.log_level)
    set_process_title("pagedserve: scheduler")
    from common.control_token import accepted_tokens
    from scheduler.control import ControlState, SchedulerControlServicer, start_control_server
    from scheduler.scheduler_service import SchedulerService

    import zmq

    config = engine_config_from_args(args)
    tokens = accepted_tokens(args.api_key)  # none: the control service stays open
    control = ControlState()
    service = None
    try:
        service = SchedulerService(config, args.scheduler_address, args.worker_address, control,
                                   frontend_timeout_s=args.frontend_timeout, log_stats=not args.disable_log_stats,
                                   max_waiting_requests=args.max_waiting_requests or None,
                                   worker_step_timeout_s=args.worker_step_timeout or None)
        server = start_control_server(args.scheduler_control_address, SchedulerControlServicer(
            control, config.model, service.request_reset_prefix_cache, config.max_logprobs),
            tokens=tokens, tls=args.tls)
    except (OSError, zmq.ZMQError) as e:  # an address in use or malformed
        logger.error("cannot start the scheduler: %s", e)
        if service is not None:
            service.close()
        return 1
    logger.info("scheduler listening: frontends %s, workers %s, control %s%s%s", args.scheduler_address,
                args.worker_address, args.scheduler_control_address, " (TLS)" if args.tls else "",
                "; token required" if tokens else "")

    on_stop_signals(lambda: setattr(service, "running", False))
    try:
        service.run()
    finally:
        server.stop(grace=None)
        service.close()
    return 0
