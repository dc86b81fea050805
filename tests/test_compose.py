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
    """PAGEDSERVE_* names the code reads, directly or through env_default/default_address."""
    names: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            names |= set(re.findall(r"\b(PAGEDSERVE_[A-Z0-9_]+)\b", text))
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
