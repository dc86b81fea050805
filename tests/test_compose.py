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


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """compose's variable substitution: ${VAR}, ${VAR:-default} (unset or empty) and
    ${VAR-default} (unset), with no variable set unless `env` says so."""
    env = env or {}

    def value(match: re.Match) -> str:
        name, op, default = match.group(1), match.group(2), match.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")
    return re.sub(r"\$\{([A-Z0-9_]+)(?:(:?-)([^}]*))?\}", value, text)


def load(name: str, env: dict[str, str] | None = None) -> dict:
    return yaml.safe_load(interpolate((ROOT / name).read_text(), env))


@pytest.fixture(scope="module")
def compose() -> dict:
    return load("compose.yaml")


def pagedserve_services(compose: dict) -> dict:
    """The services that run the pagedserve image (not the monitoring profile's Prometheus/Grafana)."""
    return {name: s for name, s in compose["services"].items() if s.get("image", "").startswith("pagedserve:")}


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
    for name, service in pagedserve_services(compose).items():
        command = service["command"]
        assert command[0] == "pagedserve" and command[1] in COMMANDS, f"{name}: {command}"
        for key, value in service.get("environment", {}).items():
            # Flags default from the service's environment. `${VAR:-}` is an empty string to compose
            # (it substitutes inside the scalar); substituted as text here, it reads as YAML null.
            monkeypatch.setenv(key, "" if value is None else str(value))
        module = importlib.import_module(COMMANDS[command[1]][0])
        parser = module.build_parser()
        parser.raise_errors = True  # a ConfigError naming the setting, not an exit
        assert module.parse_args(parser, command[2:]) is not None  # the checks the component starts with


def test_compose_sets_only_variables_the_code_reads(compose):
    known = env_vars_read_by_code()
    for name, service in pagedserve_services(compose).items():
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


def test_the_monitoring_profile_scrapes_the_frontend_and_provisions_the_dashboard(compose):
    """`--profile monitoring`: Prometheus scrapes the frontend's published /metrics port, Grafana
    reads that Prometheus and loads the dashboard from the folder the provider names."""
    services = compose["services"]
    monitoring = {name for name, s in services.items() if "monitoring" in s.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"} == set(services) - set(pagedserve_services(compose))
    mounts = {name: dict(v.rsplit(":", 1)[0].split(":", 1) for v in services[name]["volumes"] if v.startswith("./"))
              for name in monitoring}
    for name, files in mounts.items():
        for source in files:
            assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
    prometheus_config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    (job,) = prometheus_config["scrape_configs"]
    (target,) = [t for c in job["static_configs"] for t in c["targets"]]
    frontend = services["frontend"]
    port = dict(zip(frontend["command"][2::2], frontend["command"][3::2]))["--port"]
    assert target == f"frontend:{port}" and job.get("metrics_path", "/metrics") == "/metrics"
    assert "internal" in services["prometheus"]["networks"] and "internal" in services["grafana"]["networks"]
    (datasource,) = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/pagedserve.yaml").read_text())["providers"]
    assert mounts["grafana"]["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["grafana"]["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    assert all(p.startswith("127.0.0.1:") for p in services["grafana"]["ports"]), "Grafana only on localhost"


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


def test_the_gpu_override_gives_the_worker_nvidia_gpus_and_a_cuda_image():
    """compose.gpu.yaml over compose.yaml: the worker reserves NVIDIA GPUs and runs on cuda, and
    every service runs one CUDA image built with PyPI's torch and Triton."""
    base, gpu = load("compose.yaml"), load("compose.gpu.yaml")
    assert set(gpu["services"]) <= set(base["services"])
    assert set(gpu["services"]) >= {"scheduler", "tokenizer-router", "tokenizer", "frontend", "worker"}
    images = {service["image"] for service in gpu["services"].values()}
    assert images == {"pagedserve:cuda"} and base["services"]["worker"]["image"] != "pagedserve:cuda"
    for name, service in gpu["services"].items():
        args = service["build"]["args"]
        assert args["TORCH_INDEX_URL"] == "" and args["PIP_EXTRAS"] == "triton", name
    worker = gpu["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert worker["environment"]["PAGEDSERVE_DEVICE"] == "cuda"
    known = env_vars_read_by_code()
    assert set(worker["environment"]) <= known
    dockerfile = (ROOT / "Dockerfile").read_text()
    for arg in ("BASE_IMAGE", "TORCH_INDEX_URL", "PIP_EXTRAS"):
        assert f"ARG {arg}" in dockerfile, f"the Dockerfile takes no {arg}"


def test_compose_itself_reads_both_files():
    """The compose command that is installed (v2 or Debian's 1.29) accepts the files as they are."""
    import shutil
    command = (["docker", "compose"] if shutil.which("docker") and subprocess.run(
        ["docker", "compose", "version"], capture_output=True).returncode == 0 else ["docker-compose"])
    if not shutil.which(command[0]):
        pytest.skip("no compose command installed (make compose-test installs one)")
    for files, profiles in ((["compose.yaml"], []), (["compose.yaml"], ["monitoring"]),
                            (["compose.yaml", "compose.gpu.yaml"], [])):
        args = [x for f in files for x in ("-f", f)] + [x for p in profiles for x in ("--profile", p)]
        result = subprocess.run([*command, *args, "config", "-q"], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
