"""`pagedserve frontend`: the OpenAI-compatible HTTP API and the gRPC API, in
one process and one event loop. Needs a scheduler and a tokenizer pool
(addresses from flags or PAGEDSERVE_* environment variables)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket

from common.addresses import default_address
from common.cli_args import (MODEL_HELP, SettingsParser, add_log_level_arg, add_model_source_args, env_default,
                             env_setting, env_switch, parse_size, port_number, positive_float)
from common.errors import USAGE_ERROR, ConfigError, InvalidRequestError
from common.generation_defaults import SOURCES_HELP, generation_config_source
from common.logging_setup import setup_logging
from common.media_args import add_limit_mm_arg, image_limit
from common.proctitle import set_process_title
from common.tls_files import TlsFiles
from frontend.frontend_options import add_frontend_options
from frontend.lora_modules import add_max_lora_rank_arg
from frontend.tool_parsers.tool_parser_registry import TOOL_PARSERS, TOOL_PARSERS_HELP, check_tool_choice_args

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY = "16MiB"


def add_api_args(parser: argparse.ArgumentParser) -> None:
    """The frontend flags `serve` has too, with the same PAGEDSERVE_* defaults: serve
    hands its values on, so they must be the ones its frontend would read
    (a flag, else the variable, else the default)."""
    g = parser.add_argument_group("API")
    g.add_argument("--host", default=env_default("HOST", "127.0.0.1"), help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=port_number, default=env_default("PORT", 8000),
                   help="HTTP port (default 8000; 0 = any free port)")
    g.add_argument("--grpc-port", type=port_number, default=env_default("GRPC_PORT", 50051),
                   help="gRPC port (default 50051; 0 = any free port)")
    names = env_default("SERVED_MODEL_NAME", None)
    g.add_argument("--served-model-name", nargs="+", default=names.replace(",", " ").split() if names else None,
                   help="model name(s) clients use; the first is reported in responses (default: --model; "
                        "env PAGEDSERVE_SERVED_MODEL_NAME, comma-separated)")
    g.add_argument("--generation-config", type=generation_config_source,
                   default=env_setting("GENERATION_CONFIG", "auto"),
                   help="sampling defaults for fields a request leaves unset: " + SOURCES_HELP +
                        " (default auto, as vLLM; env PAGEDSERVE_GENERATION_CONFIG)")
    g.add_argument("--enable-auto-tool-choice", action="store_true", default=env_switch("ENABLE_AUTO_TOOL_CHOICE"),
                   help='let tool_choice "auto" (the default with tools) run; needs --tool-call-parser (env '
                        'PAGEDSERVE_ENABLE_AUTO_TOOL_CHOICE)')
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=env_setting("TOOL_CALL_PARSER", None),
                   help=TOOL_PARSERS_HELP + " (env PAGEDSERVE_TOOL_CALL_PARSER)")


def add_frontend_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_api_args(parser)
    g = parser.add_argument_group("frontend")
    g.add_argument("--model", default=env_default("MODEL", "smollm2-135m-instruct"),
                   help="whose tokenizer to load: a tokenizer directory or " + MODEL_HELP +
                        " (default: smollm2-135m-instruct)")
    add_model_source_args(g)
    g.add_argument("--scheduler-address", default=default_address("SCHEDULER_ADDRESS"),
                   help="the scheduler's ZMQ address (env PAGEDSERVE_SCHEDULER_ADDRESS); data parallel: one per "
                        "replica, comma-separated")
    g.add_argument("--scheduler-control-address", default=default_address("SCHEDULER_CONTROL_ADDRESS"),
                   help="the scheduler's gRPC control service (env PAGEDSERVE_SCHEDULER_CONTROL_ADDRESS); data "
                        "parallel: one per replica, comma-separated, in the order of --scheduler-address")
    g.add_argument("--tokenizer-address", default=default_address("TOKENIZER_ADDRESS"),
                   help="the tokenizer pool's ZMQ address (env PAGEDSERVE_TOKENIZER_ADDRESS)")
    g.add_argument("--model-cache-dir", default=env_default("CACHE_DIR", None),
                   help="where converted GGUF models are kept (default ~/.cache/pagedserve/models)")
    g.add_argument("--api-key", default=env_default("API_KEY", None),
                   help="require 'Authorization: Bearer <key>' on every /v1 route and every gRPC call "
                        "(/health and /metrics stay open); prefer the env PAGEDSERVE_API_KEY, which `ps` "
                        "does not show")
    g.add_argument("--request-timeout", type=positive_float, default=env_default("REQUEST_TIMEOUT", None) or None,
                   help="fail a request (HTTP 504, gRPC DEADLINE_EXCEEDED) and abort it when it has not "
                        "finished this many seconds after submission (default: no limit; env "
                        "PAGEDSERVE_REQUEST_TIMEOUT)")
    g.add_argument("--max-request-body-size", type=parse_size,
                   default=env_default("MAX_REQUEST_BODY_SIZE", DEFAULT_MAX_BODY),
                   help="refuse HTTP bodies larger than this with 413, e.g. 16MiB (default %(default)s)")
    add_limit_mm_arg(g)
    add_max_lora_rank_arg(g)
    add_log_level_arg(g)
    add_frontend_options(parser)
    return parser


def address_list(value: str) -> list[str]:
    """One address per replica, comma-separated."""
    return [address.strip() for address in value.split(",") if address.strip()]


def served_names(args: argparse.Namespace) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    from common.model_files import model_display_name

    return [model_display_name(args.model)]


def raise_open_file_limit(wanted: int = 65536) -> None:
    """Each client connection is a file descriptor: a soft limit of 1024 would
    refuse the 1000th concurrent stream. Raise it toward the hard limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            logger.warning("cannot raise the open file limit from %d: %s", soft, e)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before serving so the real port is known (and logged) even for port 0."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:  # in use, or a host that does not resolve to this machine
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port} (HTTP): {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


async def run_frontend(args: argparse.Namespace) -> None:
    import prometheus_client
    import uvicorn

    from common.generation_defaults import sampling_defaults
    from common.model_files import resolve_tokenizer_dir
    from common.tokenizer import load_tokenizer
    from frontend.api_server import build_app
    from frontend.graceful_shutdown import GracefulServer
    from frontend.grpc.grpc_server import start_grpc_server
    from frontend.frontend_options import CorsSettings
    from frontend.engine.request_log import RequestLogger
    from frontend.engine.frontend_metrics import FrontendMetrics
    from frontend.frontend_state import FrontendState
    from frontend.lora_modules import LoRAModules
    from tokenizer_pool.tokenizer_client import TokenizerClient

    # Like vLLM: no `*_created` series (they double the exposition for nothing).
    prometheus_client.disable_created_metrics()
    names = served_names(args)
    try:
        lora_modules = LoRAModules(args.lora_modules, args.max_lora_rank)
    except InvalidRequestError as e:  # an adapter that cannot be served: a usage error, no traceback
        raise ConfigError(f"--lora-modules: {e.message}") from None
    tokenizer_dir = resolve_tokenizer_dir(args.model, args.model_cache_dir, revision=args.revision,
                                          gguf_file=args.gguf_file)
    tokenizer = load_tokenizer(tokenizer_dir)
    metrics = FrontendMetrics(names[0], num_replicas=len(args.scheduler_address))
    engine, control = engine_clients(args, metrics)
    tokenizer_client = TokenizerClient(args.tokenizer_address)
    state = FrontendState(served_model_names=names, model_root=args.model, engine=engine,
                          tokenizer_client=tokenizer_client, tokenizer=tokenizer, control=control,
                          metrics=metrics, lora_modules=lora_modules,
                          sampling_defaults=sampling_defaults(tokenizer_dir, args.generation_config),
                          tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                          response_role=args.response_role, image_limit=image_limit(args.limit_mm_per_prompt),
                          return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                          request_logger=(RequestLogger(tokenizer, args.max_log_len)
                                          if args.enable_log_requests else None))
    await engine.start()
    http_socket = bind_socket(args.host, args.port)
    tls = TlsFiles.from_args(args)
    grpc_server, grpc_port = await start_grpc_server(state, args.host, args.grpc_port, api_key=args.api_key,
                                                     tls_key_pair=tls.grpc_key_pair() if tls else None)
    # log_config=None: uvicorn's records go through our handler and format.
    app = build_app(state, api_key=args.api_key, max_body_bytes=args.max_request_body_size,
                    cors=CorsSettings.from_args(args), playground=not args.disable_playground)
    server = GracefulServer(uvicorn.Config(app, log_config=None, access_log=not args.disable_uvicorn_access_log,
                                           ssl_keyfile=tls.keyfile if tls else None,
                                           ssl_certfile=tls.certfile if tls else None),
                            engine, grpc_server,
                            tokenizer_client=tokenizer_client)
    http_port = http_socket.getsockname()[1]
    logger.info("frontend %s serving %s: OpenAI API on %s://%s:%d/v1, gRPC%s on %s:%d "
                "(scheduler %s, control %s, tokenizer pool %s)%s", engine.frontend_id, ", ".join(names),
                "https" if tls else "http", args.host, http_port, " (TLS)" if tls else "", args.host, grpc_port,
                engine.scheduler_address, control.address, args.tokenizer_address,
                "; API key required" if args.api_key else "")
    if not args.disable_playground:
        logger.info("playground page on %s://%s:%d/", "https" if tls else "http", args.host, http_port)
    try:
        await server.serve(sockets=[http_socket])
    finally:
        await grpc_server.stop(grace=2)
        await engine.close()
        await tokenizer_client.close()
        await control.close()
        http_socket.close()


def engine_clients(args: argparse.Namespace, metrics):
    """(engine, control): the scheduler's clients, or with several schedulers (data
    parallel) a ReplicaRouter and ReplicaControls over one pair per replica."""
    from common.control_token import client_token
    from frontend.engine.control_client import ControlClient
    from frontend.engine.engine_client import EngineClient, new_frontend_id

    frontend_id = new_frontend_id()
    pairs = []
    token, tls = client_token(args.api_key), TlsFiles.from_args(args)  # the scheduler has the same secrets
    for scheduler_address, control_address in zip(args.scheduler_address, args.scheduler_control_address):
        control = ControlClient(control_address, token=token, tls=tls)

        async def scheduler_alive(control=control) -> bool:
            # The stall watchdog's second opinion: a live engine loop keeps requests
            # safe even while its worker is being replaced, so only a dead or hung
            # scheduler fails them.
            reply = await control.health()
            return reply is not None and reply.ok

        restart_timeout = args.scheduler_restart_timeout
        pairs.append((EngineClient(scheduler_address, frontend_id=frontend_id, health_probe=scheduler_alive,
                                   request_timeout=args.request_timeout, restart_timeout=restart_timeout,
                                   connect_grace=min(restart_timeout, args.request_timeout or restart_timeout),
                                   on_resubmit=metrics.record_resubmitted),
                      control))
    if len(pairs) == 1:
        return pairs[0]
    from frontend.engine.replica_controls import ReplicaControls
    from frontend.engine.replica_router import ReplicaRouter

    router = ReplicaRouter(pairs, on_route=metrics.record_routed)
    return router, ReplicaControls(router.replicas)


def build_parser() -> SettingsParser:
    return add_frontend_args(SettingsParser(prog="pagedserve frontend", description=__doc__))


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The settings, checked: what cannot run is a usage error here (also `serve`'s check)."""
    args = parser.parse_args(argv)
    args.scheduler_address = address_list(args.scheduler_address)
    args.scheduler_control_address = address_list(args.scheduler_control_address)
    if len(args.scheduler_address) != len(args.scheduler_control_address):
        parser.error(f"{len(args.scheduler_address)} scheduler address(es) but "
                     f"{len(args.scheduler_control_address)} control address(es): give one of each per replica")
    check_tool_choice_args(parser, args)
    try:
        TlsFiles.from_args(args)  # a missing key fails here, not after the servers started
    except ConfigError as e:
        parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    setup_logging("frontend", args.log_level)
    set_process_title("pagedserve: frontend")
    raise_open_file_limit()
    import zmq

    try:
        import uvloop  # optional: faster event loop when installed
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(run_frontend(args))
    except ConfigError as e:
        logger.error("%s", e)
        return USAGE_ERROR
    except (OSError, zmq.ZMQError) as e:  # a port in use, a host or address that cannot be used
        logger.error("cannot start the frontend: %s", e)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
