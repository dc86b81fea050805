"""`pagedserve scheduler`: the scheduler process (one per model replica)."""
from __future__ import annotations

import argparse
import logging

from common.addresses import default_address
from common.cli_args import (SettingsParser, add_engine_args, add_log_level_arg, engine_config_from_args, env_default, non_negative_float,
                             non_negative_int, parse_engine_args, positive_float)
from common.logging_setup import setup_logging
from common.proctitle import set_process_title
from common.signals import on_stop_signals

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
    add_log_level_arg(parser)
    return add_engine_args(parser)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The settings, checked (also `serve`'s check)."""
    return parse_engine_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    setup_logging("scheduler", args.log_level)
    set_process_title("pagedserve: scheduler")
    from scheduler.control import ControlState, SchedulerControlServicer, start_control_server
    from scheduler.scheduler_service import SchedulerService

    import zmq

    config = engine_config_from_args(args)
    control = ControlState()
    service = None
    try:
        service = SchedulerService(config, args.scheduler_address, args.worker_address, control,
                                   frontend_timeout_s=args.frontend_timeout, log_stats=not args.disable_log_stats,
                                   max_waiting_requests=args.max_waiting_requests or None,
                                   worker_step_timeout_s=args.worker_step_timeout or None)
        server = start_control_server(args.scheduler_control_address, SchedulerControlServicer(
            control, config.model, service.request_reset_prefix_cache, config.max_logprobs))
    except (OSError, zmq.ZMQError) as e:  # an address in use or malformed
        logger.error("cannot start the scheduler: %s", e)
        if service is not None:
            service.close()
        return 1
    logger.info("scheduler listening: frontends %s, workers %s, control %s", args.scheduler_address,
                args.worker_address, args.scheduler_control_address)

    on_stop_signals(lambda: setattr(service, "running", False))
    try:
        service.run()
    finally:
        server.stop(grace=None)
        service.close()
    return 0
