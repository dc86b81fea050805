"""`pagedserve worker`: the model worker for one device."""
from __future__ import annotations

import argparse
import logging
import os

from common.addresses import default_address
from common.cli_args import SettingsParser, add_engine_args, add_log_level_arg, engine_config_from_args, parse_engine_args, positive_float
from common.errors import USAGE_ERROR, ConfigError
from common.logging_setup import setup_logging
from common.proctitle import set_process_title
from common.signals import on_stop_signals

logger = logging.getLogger(__name__)


def build_parser() -> SettingsParser:
    parser = SettingsParser(prog="pagedserve worker", description=__doc__)
    parser.add_argument("--worker-address", default=default_address("WORKER_ADDRESS"),
                        help="the scheduler's ZMQ address for workers")
    parser.add_argument("--rank", type=int, default=int(os.environ.get("RANK", "0")),
                        help="this worker's rank in its tensor/pipeline-parallel group (default: $RANK, as "
                             "torchrun sets it, else 0); only rank 0 talks to the scheduler")
    parser.add_argument("--handshake-timeout", type=positive_float, default=None,
                        help="give up if the scheduler does not answer within this many seconds")
    add_log_level_arg(parser)
    return add_engine_args(parser)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The settings, checked (also `serve`'s check)."""
    return parse_engine_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    setup_logging(f"worker {args.rank}", args.log_level)
    set_process_title(f"pagedserve: worker {args.rank}")
    from worker.worker_service import WorkerService
    from worker.encoder_worker import make_worker

    import zmq

    config = engine_config_from_args(args)
    try:
        worker = make_worker(config, rank=args.rank)  # a BERT-style encoder gets the encoder worker
    except ConfigError as e:  # settings this model cannot run with (a KV cache too small): a usage error
        logger.error("cannot start the worker: %s", e)
        return USAGE_ERROR
    except RuntimeError as e:
        if config.world_size == 1:
            raise
        return _group_broken(e)  # e.g. joined the store of a group whose rank 0 was on its way out
    if args.rank != 0:
        return _follow(worker)
    try:
        service = WorkerService(worker, args.worker_address, handshake_timeout_s=args.handshake_timeout)
    except zmq.ZMQError as e:  # a malformed address
        logger.error("cannot start the worker: %s", e)
        return 1

    on_stop_signals(lambda: setattr(service, "running", False))
    try:
        service.run()
    except TimeoutError as e:  # --handshake-timeout passed
        logger.error("%s at %s within %gs", e, args.worker_address, args.handshake_timeout)
        return 1
    except Exception as e:
        if config.world_size == 1:
            raise
        return _group_broken(e)
    finally:
        service.close()
    return 0


def _follow(worker) -> int:
    """Ranks other than 0: follow rank 0 until it stops the group (or the group breaks)."""
    from worker.distributed.group_follower import follow

    try:
        logger.info("%s", follow(worker))
    except Exception as e:
        return _group_broken(e)
    return 0


def _group_broken(error: Exception) -> int:
    """A rank of the group died (or failed): this one exits too, so that the whole group restarts."""
    logger.error("the worker group broke (%s: %s); exiting so that the group restarts together",
                 type(error).__name__, str(error).strip().splitlines()[0] if str(error).strip() else "")
    return 1
