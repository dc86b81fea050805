"""compose.yaml must run real commands: no docker engine here, so check what we can.

Every service's command parses with the real `pagedserve` CLI, and every
PAGEDSERVE_* variable compose sets is one the code actually reads.
"""
from __future__ import annotations

import importlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pagedserve.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pagedserve", "common", "scheduler", "worker", "frontend", "tokenizer_pool")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def env_vars_read_by_code() -> set[str]:
    """PAGEDSERVE_* names the code reads, directly or through env_default/default_address, and
    other variables it reads from os.environ (torchrun's LOCAL_RANK, ...)."""
    names: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            names |= set(re.findall(r"\b(PAGEDSERVE_[A-Z0-9_]+)\b", text))
            names |= set(re.findall(r"os\.environ(?:\.get\(|\[)\s*\"([A-Z0-9_]+)\"", text))
            names |= {f"PAGEDSERVE_{n}" for n in re.findall(
                r"(?:env_default|env_setting|env_switch|default_address)\(\s*\"([A-Z0-9_]+)\"", text)}
    from common.addresses import DEFAULTS
    names |= {f"PAGEDSERVE_{n}" for n in DEFAULTS}
    return names


def test_the_four_component_services_exist_and_tokenizer_scales(compose):
    services = compose["services"]
    for name in ("frontend", "tokenizer", "scheduler", "worker"):
        assert name in services, f"compose.yaml lacks the {name} service"
    tokenizer = services["tokenizer"]
    assert "container_name" not in tokenizer and "ports" not in tokenizer, "tokenizer must be scalable"
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
    assert compose["networks"]["internal"].get("internal") is True
    assert "model-cache" in compose["volumes"]


def test_every_service_command_parses_with_the_real_cli(compose, monkeypatch):
    for name, service in compose["services"].items():
        command = service["command"]
        assert command[0] == "pagedserve" and command[1] in COMMANDS, f"{name}: {command}"
        for key, value in service.get("environment", {}).items():
            monkeypatch.setenv(key, str(value))  # flags default from the service's environment
        module = importlib.import_module(COMMANDS[command[1]][0])
        parser = module.build_parser()
        parser.raise_errors = True  # a ConfigError naming the setting, not an exit
        assert module.parse_args(parser, command[2:]) is not None  # the checks the component starts with


def test_compose_sets_only_variables_the_code_reads(compose):
    known = env_vars_read_by_code()
    for name, service in compose["services"].items():
        for key in service.get("environment", {}):
            assert key in known, f"{name} sets {key}, which no code reads"


def test_the_tp2_profile_is_one_worker_group_of_two_ranks(compose):
    """`--profile tp2`: two ranks with the same engine settings meeting at rank 0's service;
    only rank 0 is told where the scheduler is (rank 1 follows it)."""
    services = compose["services"]
    group = {name: s for name, s in services.items() if "tp2" in s.get("profiles", [])}
    assert sorted(group) == ["worker-tp2-rank0", "worker-tp2-rank1"]
    assert all("profiles" not in services[name] for name in ("frontend", "scheduler", "worker", "tokenizer"))
    commands = {}
    for name, service in group.items():
        command = service["command"]
        assert command[:2] == ["pagedserve", "worker"], name
        flags = dict(zip(command[2::2], command[3::2]))
        assert flags["--tensor-parallel-size"] == "2"
        host, port = flags["--distributed-init-method"].removeprefix("tcp://").rsplit(":", 1)
        assert host == "worker-tp2-rank0" and int(port) > 0, "the group meets at rank 0's service"
        commands[int(flags.pop("--rank"))] = (flags, service["environment"])
        assert service["restart"] == "unless-stopped", "a broken group must come back by itself"
    assert sorted(commands) == [0, 1]
    (flags0, env0), (flags1, env1) = commands[0], commands[1]
    assert flags0 == flags1, "every rank needs the same engine settings"
    for key in set(env0) | set(env1):
        if key != "LOCAL_RANK":
            assert env0.get(key) == env1.get(key), f"the ranks differ in {key}"
    assert (env0["LOCAL_RANK"], env1["LOCAL_RANK"], env0["LOCAL_WORLD_SIZE"]) == ("0", "1", "2")
    assert "--worker-address" not in flags0 and env0["PAGEDSERVE_WORKER_ADDRESS"] == "tcp://scheduler:5558"
    assert group["worker-tp2-rank0"]["depends_on"] == {"scheduler": {"condition": "service_healthy"}}


def run_healthcheck(test: list[str], visible_pids: list[int | str]) -> int:
    """Run a `CMD python -c CODE` healthcheck seeing only these /proc entries ("self": its own)."""
    assert test[:3] == ["CMD", "python", "-c"], test
    prelude = ("import glob, os\n"
               f"pids = [str(os.getpid()) if p == 'self' else str(p) for p in {visible_pids!r}]\n"
               "glob.glob = lambda pattern: [f'/proc/{p}/cmdline' for p in pids]\n")
    return subprocess.run([sys.executable, "-c", prelude + test[3]], timeout=30).returncode


def test_the_tokenizer_healthcheck_does_not_count_itself(compose):
    """Its command line holds the process title it looks for: it must not find itself."""
    test = compose["services"]["tokenizer"]["healthcheck"]["test"]
    assert run_healthcheck(test, ["self"]) == 1
    titled = subprocess.Popen([sys.executable, "-c", "import setproctitle, time; "
                               "setproctitle.setproctitle('pagedserve: tokenizer 1'); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{titled.pid}/cmdline").read_bytes().startswith(b"pagedserve: tokenizer"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert run_healthcheck(test, ["self", titled.pid]) == 0
    finally:
        titled.kill()
        titled.wait()
