"""Driving the real compose stack from tests: the compose command, its containers, health."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "pagedserve-compose-test"
LABEL = "com.docker.compose"
REPORT: list[str] = []  # measurements the run prints at its end (tests/compose/conftest.py)


def run(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 600,
        check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True,
                            text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{shlex.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}"
                             f"\n{result.stderr[-3000:]}")
    return result


class Stack:
    """One compose project on this machine, its published ports chosen by the test."""

    def __init__(self, env: dict[str, str]):
        self.compose = shlex.split(os.environ.get("PAGEDSERVE_COMPOSE", "docker compose"))
        self.env = dict(env)

    def __call__(self, *args: str, env: dict[str, str] | None = None, timeout: float = 600,
                 check: bool = True) -> subprocess.CompletedProcess:
        return run([*self.compose, "-p", PROJECT, "-f", "compose.yaml", *args],
                   env={**self.env, **(env or {})}, timeout=timeout, check=check)

    def containers(self, service: str | None = None, *, all: bool = False) -> list[str]:
        """IDs of this project's containers (of one service), running only unless `all`."""
        args = ["docker", "ps", "-q", "--no-trunc", "--filter", f"label={LABEL}.project={PROJECT}"]
        if service:
            args += ["--filter", f"label={LABEL}.service={service}"]
        if all:
            args.append("-a")
        return run(args).stdout.split()

    def inspect(self, container: str) -> dict:
        return json.loads(run(["docker", "inspect", container]).stdout)[0]

    def service_of(self, container: str) -> str:
        return self.inspect(container)["Config"]["Labels"][f"{LABEL}.service"]

    def logs(self, container: str) -> str:
        result = run(["docker", "logs", container])
        return result.stdout + result.stderr

    def unhealthy(self) -> list[str]:
        """'service: state' for every container of the project not running and healthy."""
        problems = []
        for container in self.containers(all=True):
            state = self.inspect(container)["State"]
            health = state.get("Health", {}).get("Status", "none")
            if state["Status"] != "running" or health != "healthy":
                problems.append(f"{self.service_of(container)}: {state['Status']}/{health}")
        return problems

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until every container is running and healthy; on a timeout, the logs of those
        that are not go into the AssertionError."""
        start = time.monotonic()
        while True:
            problems = self.unhealthy()
            if not problems and self.containers():
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                tails = []
                for container in self.containers(all=True):
                    name = self.service_of(container)
                    if any(p.startswith(name + ":") for p in problems):
                        tails.append(f"--- {name} ---\n{self.logs(container)[-3000:]}")
                raise AssertionError(f"not healthy after {timeout:g}s: {problems}\n" + "\n".join(tails))
            time.sleep(2)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes that still carry this project's label."""
        label = f"label={LABEL}.project={PROJECT}"
        return {
            "containers": self.containers(all=True),
            "networks": run(["docker", "network", "ls", "-q", "--filter", label]).stdout.split(),
            "volumes": run(["docker", "volume", "ls", "-q", "--filter", label]).stdout.split(),
        }
