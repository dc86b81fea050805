"""`pagedserve serve`: start every component on this host and keep them running.

Starts the tokenizer pool, scheduler, worker and frontend as separate OS
processes talking over ZeroMQ/gRPC on Unix sockets in a private runtime
directory (so two servers never collide on ports), waits until the API
answers, restarts any component that exits (with backoff), and on Ctrl-C or
SIGTERM stops them all, leaving no orphans.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from common.cli_args import (SettingsParser, add_engine_args, add_log_level_arg, engine_argv, engine_config,
                             env_default, non_negative_int, positive_float, use_local_model)
from common.errors import USAGE_ERROR, ConfigError
from common.logging_setup import setup_logging
from common.media_args import add_allowed_media_domains_arg, media_argv
from common.lora_request import LoRAAdapterError, check_adapter_files
from common.model_files import check_quantization_source
from common.parallel_layout import check_model_layout
from common.proctitle import set_process_title
from common.runtime_dir import create_runtime_dir, remove_stale_runtime_dirs
from pagedserve.settings_check import check_settings
from pagedserve.process_supervisor import Component, Supervisor, free_tcp_port
from frontend.frontend_cli import add_api_args
from frontend.frontend_options import add_frontend_options, frontend_options_argv, tls_files_argv
from tokenizer_pool.tokenizer_pool_cli import add_chat_template_arg

logger = logging.getLogger("pagedserve.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = SettingsParser(prog="pagedserve serve", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_tag", nargs="?", default=None, help="model (same as --model)")
    # Flags serve hands on read the components' own PAGEDSERVE_* defaults (add_api_args,
    # add_chat_template_arg ...): a default of serve's must not mask a variable the
    # operator set. Settings serve has no flag for reach the components by inheritance.
    add_api_args(parser)
    parser.add_argument("--tokenizer-pool-size", type=non_negative_int, default=env_default("TOKENIZER_POOL_SIZE", 2),
                        help="tokenizer processes (default 2; env PAGEDSERVE_TOKENIZER_POOL_SIZE)")
    parser.add_argument("--api-key", default=env_default("API_KEY", None),
                        help="require this key on every /v1 route and gRPC call (env PAGEDSERVE_API_KEY; "
                             "handed to the frontend through its environment, never its command line)")
    parser.add_argument("--max-waiting-requests", type=non_negative_int, default=None,
                        help="refuse new requests with 429 while this many wait (scheduler default 4096; 0 = no "
                             "limit; env PAGEDSERVE_MAX_WAITING_REQUESTS, which the scheduler reads)")
    parser.add_argument("--request-timeout", type=positive_float, default=None,
                        help="fail and abort requests not finished after this many seconds (default: no limit; "
                             "env PAGEDSERVE_REQUEST_TIMEOUT, which the frontend reads)")
    add_chat_template_arg(parser)
    add_allowed_media_domains_arg(parser)  # (--limit-mm-per-prompt is an engine flag)
    add_log_level_arg(parser)
    parser.add_argument("--disable-log-stats", action="store_true")
    parser.add_argument("--runtime-dir", default=None, help="where internal sockets live (default: a temp dir)")
    parser.add_argument("--ready-timeout", type=positive_float, default=600.0,
                        help="seconds to wait for every component to become ready")
    add_frontend_options(parser)
    return add_engine_args(parser)


def component_commands(args: argparse.Namespace, runtime_dir: str) -> list[Component]:
    config = engine_config(args)  # ConfigError for one that cannot run
    if getattr(args, "lora_modules", None) and not config.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    for name, path in getattr(args, "lora_modules", None) or []:  # before any component starts
        try:
            check_adapter_files(path, config.max_lora_rank)
        except (LoRAAdapterError, OSError) as e:
            raise ConfigError(f"--lora-modules {name}: {e}") from None
    ipc = lambda name: f"ipc://{runtime_dir}/{name}"  # noqa: E731
    addresses = {"tokenizer": ipc("tokenizer"), "tokenizer_backend": ipc("tokenizer-backend")}
    replicas = replica_addresses(config, runtime_dir)
    engine = engine_argv(config)
    # The tokenizer pool and the frontend need only the tokenizer (--tokenizer, else the model's).
    model = ["--model", config.tokenizer or config.model] + (["--model-cache-dir", config.model_cache_dir]
                                                             if config.model_cache_dir else [])
    stats = ["--disable-log-stats"] if args.disable_log_stats else []
    chat_template = [] if args.chat_template is None else ["--chat-template", _absolute_if_file(args.chat_template)]
    frontend = ["--host", args.host, "--port", str(args.port), "--grpc-port", str(args.grpc_port),
                "--scheduler-address", ",".join(r.scheduler_address for r in replicas),
                "--scheduler-control-address", ",".join(r.control_address for r in replicas),
                "--tokenizer-address", addresses["tokenizer"],
                "--served-model-name", *served_model_names(args, config.model),
                "--generation-config", _generation_config(args.generation_config, config)]
    if args.enable_auto_tool_choice:
        frontend += ["--enable-auto-tool-choice"]
    if args.tool_call_parser:
        frontend += ["--tool-call-parser", args.tool_call_parser]
    if args.request_timeout is not None:
        frontend += ["--request-timeout", str(args.request_timeout)]
    frontend += frontend_options_argv(args) + media_argv(args, domains=False)
    scheduler = ([] if args.max_waiting_requests is None
                 else ["--max-waiting-requests", str(args.max_waiting_requests)])
    scheduler += tls_files_argv(args)  # its control service: TLS with the frontend's key, which trusts it
    # The key goes through the environment: a command line is visible to every local user (ps).
    # The scheduler's control service requires it too.
    key_env = {"PAGEDSERVE_API_KEY": args.api_key} if args.api_key else {}
    components = [
        # Not PAGEDSERVE_TOKENIZER_JOIN: this pool is the router (empty means unset).
        Component("tokenizer", ["tokenizer", *model, *chat_template, *media_argv(args),
                                "--tokenizer-pool-size", str(args.tokenizer_pool_size),
                                "--frontend-address", addresses["tokenizer"],
                                "--backend-address", addresses["tokenizer_backend"]],
                  env={"PAGEDSERVE_TOKENIZER_JOIN": ""}),
        *[component for r in replicas for component in (
            Component(r.scheduler_name, ["scheduler", *engine, *stats, *scheduler,
                                         "--scheduler-address", r.scheduler_address,
                                         "--worker-address", r.worker_address,
                                         "--scheduler-control-address", r.control_address],
                      env=key_env),
            *r.workers(config, engine))],
        Component("frontend", ["frontend", *model, *frontend], env=key_env),
    ]
    for component in components if args.log_level else []:
        component.argv += ["--log-level", args.log_level]
    return components


@dataclass(frozen=True)
class ReplicaAddresses:
    """One engine replica's names and internal addresses. Data parallel (D > 1):
    scheduler-dp<i> and worker-dp<i> on sockets scheduler-<i>, worker-<i>, control-<i>;
    a single replica keeps the plain names and sockets."""
    index: int
    data_parallel_size: int
    runtime_dir: str

    def _name(self, base: str, separator: str) -> str:
        return base if self.data_parallel_size == 1 else f"{base}{separator}{self.index}"

    @property
    def scheduler_name(self) -> str:
        return self._name("scheduler", "-dp")

    @property
    def scheduler_address(self) -> str:
        return f"ipc://{self.runtime_dir}/{self._name('scheduler', '-')}"

    @property
    def worker_address(self) -> str:
        return f"ipc://{self.runtime_dir}/{self._name('worker', '-')}"

    @property
    def control_address(self) -> str:
        return f"unix:{self.runtime_dir}/{self._name('control', '-')}"

    def workers(self, config, engine: list[str]) -> list[Component]:
        """The replica's worker group (see worker_group)."""
        return worker_group(config, engine, self.worker_address, name=self._name("worker", "-dp"),
                            replica=self.index)


def replica_addresses(config, runtime_dir: str) -> list[ReplicaAddresses]:
    return [ReplicaAddresses(i, config.data_parallel_size, runtime_dir) for i in range(config.data_parallel_size)]


def worker_group(config, engine: list[str], worker_address: str, name: str = "worker",
                 group_port: int | None = None, replica: int = 0) -> list[Component]:
    """The worker processes of replica `replica`: one, or a rank each of a tensor/pipeline-parallel
    group meeting at 127.0.0.1:`group_port` (a free port by default). Only rank 0 talks to the
    scheduler; the others follow it over torch.distributed. LOCAL_RANK / LOCAL_WORLD_SIZE count
    every replica's ranks on this host, so that all ranks split the cores (and CUDA devices)."""
    size = config.world_size
    host_ranks = {"LOCAL_WORLD_SIZE": str(config.data_parallel_size * size)}
    if size == 1:
        env = {**host_ranks, "LOCAL_RANK": str(replica)} if config.data_parallel_size > 1 else {}
        return [Component(name, ["worker", *engine, "--worker-address", worker_address], env=env)]
    init = ([] if config.distributed_init_method
            else ["--distributed-init-method", f"tcp://127.0.0.1:{group_port or free_tcp_port()}"])
    return [Component(name if rank == 0 else f"{name}-rank{rank}",
                      ["worker", *engine, *init, "--worker-address", worker_address, "--rank", str(rank)],
                      env={**host_ranks, "LOCAL_RANK": str(replica * size + rank)})
            for rank in range(size)]


def served_model_names(args: argparse.Namespace, model: str) -> list[str]:
    return args.served_model_name or [args.model_tag or model]


def _generation_config(source: str, config) -> str:
    """The frontend reads the model's sampling defaults beside its tokenizer: with a --tokenizer
    of its own, point it at the model's generation config instead."""
    if source == "auto" and config.tokenizer and os.path.isfile(os.path.join(config.model, "generation_config.json")):
        return config.model
    return source


def _absolute_if_file(value: str) -> str:
    """A file is handed on by absolute path: a component need not share our working directory."""
    path = os.path.expanduser(value)
    return os.path.abspath(path) if os.path.isfile(path) else value


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """Raise OSError if the API cannot listen on its ports. Checked up front:
    otherwise the frontend fails in a restart loop while `serve` probes the
    /health of whatever holds the port and reports *that* server ready."""
    for name, port in ports.items():
        if port == 0:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the frontend binds
            try:
                probe.bind((host, port))
            except OSError as e:
                raise OSError(e.errno, f"cannot listen on {host}:{port} ({name}): {e.strerror}") from None


def wait_until_ready(supervisor: Supervisor, url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not supervisor.stopping:
        supervisor.poll()
        if health_ok(url):
            return True
        time.sleep(0.5)
    return False


def health_ok(url: str) -> bool:
    """Whether /health at `url` answers 200. Over HTTPS the certificate is not
    checked: this is our own frontend on this host, whatever name it was issued for."""
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status == 200
    except OSError:
        return False


def checked_settings(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """serve's settings, and every component's as it would start with them (its
    argv, the environment it inherits), checked once here rather than in a
    restart loop: a usage exit, or ConfigError naming the component."""
    args = parser.parse_args(argv)
    if args.model_tag:
        args.model = args.model_tag
    # The runtime directory need not exist yet: addresses are not checked.
    check_settings(component_commands(args, args.runtime_dir or tempfile.gettempdir()))
    return args


def main(argv: list[str] | None = None) -> int:
    # First: the settings check below sets environment variables, after which
    # setproctitle can no longer rewrite the command line.
    set_process_title("pagedserve: serve")
    parser = build_parser()
    try:
        args = checked_settings(parser, argv)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    setup_logging("serve", args.log_level)
    try:
        check_ports_free(args.host, {"HTTP": args.port, "gRPC": args.grpc_port})
    except OSError as e:
        logger.error("%s", e)
        return 1
    try:  # a group size the model cannot be split by: say so now, not in every rank's restart loop
        _prepare_model(args)
        check_model_layout(engine_config(args))
        check_quantization_source(args.model, args.quantization)
    except ConfigError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    owns_runtime_dir = args.runtime_dir is None
    if owns_runtime_dir:
        remove_stale_runtime_dirs()
    runtime_dir = args.runtime_dir or create_runtime_dir()
    os.makedirs(runtime_dir, mode=0o700, exist_ok=True)  # the internal sockets: this user only
    supervisor = Supervisor(component_commands(args, runtime_dir))
    signal.signal(signal.SIGTERM, lambda *_: supervisor.request_stop())
    signal.signal(signal.SIGINT, lambda *_: supervisor.request_stop())
    try:
        supervisor.start_all()
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        scheme = "https" if args.ssl_certfile else "http"
        if wait_until_ready(supervisor, f"{scheme}://{host}:{args.port}/health", args.ready_timeout):
            print(f"pagedserve is ready: OpenAI API on {scheme}://{args.host}:{args.port}/v1 "
                  f"(model {served_model_names(args, args.model)[0]}), "
                  f"gRPC{' (TLS)' if args.ssl_certfile else ''} on {args.host}:{args.grpc_port}", flush=True)
        elif not supervisor.stopping:
            logger.error("components not ready after %.0fs; still trying (see the logs above)", args.ready_timeout)
        while not supervisor.stopping:
            supervisor.poll()
            time.sleep(0.2)
    finally:
        supervisor.stop_all()
        if owns_runtime_dir:
            shutil.rmtree(runtime_dir, ignore_errors=True)
    return supervisor.exit_code


def _prepare_model(args: argparse.Namespace) -> None:
    """Resolve the model once, up front, before any component starts: a Hub model fetched (or
    found in the cache), a GGUF converted, its architecture checked. The components then get
    the local path (all four serve that one snapshot and never ask the Hub), and the served
    name stays what the user gave (ORG/NAME for a Hub id, as vLLM). ConfigError on failure."""
    from common.model_files import model_display_name, resolve_model_dir
    from worker.models import check_architecture

    given = args.model
    use_local_model(args)
    if args.model != given and not args.served_model_name:
        args.served_model_name = [model_display_name(given)]
    try:
        model_dir = resolve_model_dir(args.model, args.model_cache_dir)
    except ConfigError:
        raise
    except Exception as e:  # a conversion that failed on a file it could not read
        raise ConfigError(f"cannot load model {given!r}: {e}") from None
    check_architecture(model_dir)
