"""`serve --data-parallel-size`: the components it would start, and the frontend's
replica addresses (no process is started here)."""
from __future__ import annotations

import pytest

from pagedserve.serve import build_parser, checked_settings, component_commands


def argv_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_two_replicas_get_their_own_names_sockets_and_core_shares():
    components = component_commands(build_parser().parse_args(["-dp", "2", "--tensor-parallel-size", "1"]), "/run")
    by_name = {c.name: c for c in components}
    assert list(by_name) == ["tokenizer", "scheduler-dp0", "worker-dp0", "scheduler-dp1", "worker-dp1", "frontend"]
    for i in (0, 1):
        scheduler, worker = by_name[f"scheduler-dp{i}"].argv, by_name[f"worker-dp{i}"].argv
        assert argv_value(scheduler, "--scheduler-address") == f"ipc:///run/scheduler-{i}"
        assert argv_value(scheduler, "--worker-address") == argv_value(worker, "--worker-address") == \
            f"ipc:///run/worker-{i}"
        assert argv_value(scheduler, "--scheduler-control-address") == f"unix:/run/control-{i}"
        assert by_name[f"worker-dp{i}"].env == {"LOCAL_RANK": str(i), "LOCAL_WORLD_SIZE": "2"}
    frontend = by_name["frontend"].argv
    assert argv_value(frontend, "--scheduler-address") == "ipc:///run/scheduler-0,ipc:///run/scheduler-1"
    assert argv_value(frontend, "--scheduler-control-address") == "unix:/run/control-0,unix:/run/control-1"
    checked_settings(build_parser(), ["-dp", "2"])  # every component parses what it is given


def test_one_replica_keeps_the_plain_names_and_sockets():
    names = [(c.name, c.env) for c in component_commands(build_parser().parse_args([]), "/run")]
    assert names == [("tokenizer", {"PAGEDSERVE_TOKENIZER_JOIN": ""}), ("scheduler", {}), ("worker", {}),
                     ("frontend", {})]


def test_the_frontend_needs_one_control_address_per_scheduler():
    from common.errors import ConfigError
    from frontend.frontend_cli import build_parser as frontend_parser, parse_args

    args = parse_args(frontend_parser(), ["--scheduler-address", "tcp://a:1, tcp://b:1",
                                          "--scheduler-control-address", "a:2,b:2"])
    assert args.scheduler_address == ["tcp://a:1", "tcp://b:1"] and args.scheduler_control_address == ["a:2", "b:2"]
    parser = frontend_parser()
    parser.raise_errors = True
    with pytest.raises(ConfigError, match="2 scheduler address"):
        parse_args(parser, ["--scheduler-address", "tcp://a:1,tcp://b:1", "--scheduler-control-address", "a:2"])
