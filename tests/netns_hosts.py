"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

Each namespace has its own loopback, its own ports and one end of the veth
link with a private address (10.42.0.1/24 and 10.42.0.2/24); nothing else is
reachable from them. Processes run in a namespace through `ip netns exec`;
the test process reaches a namespace from a thread that entered it
(`Host.client_pool()`), so clients see the hosts as a remote client would.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN): `unavailable_reason()` says
why not, for a skip. Names are unique per run, and `TwoHosts.close()` removes
both namespaces (and with them the veth pair) even when a test fails; those
of a run killed outright are removed by the next run.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from logged_process import LoggedProcess

REPO = Path(__file__).resolve().parents[1]
CLONE_NEWNET = 0x40000000
SUBNET = "10.42.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """None where this process may make network namespaces and veth pairs, else why not."""
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    tag = secrets.token_hex(3)
    probe = f"ps-probe-{tag}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return ("`ip netns add` is not permitted here (needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN): "
                + made.stderr.strip())
    try:
        veth = _ip("-n", probe, "link", "add", f"psp{tag}a", "type", "veth", "peer", "name", f"psp{tag}b",
                   check=False)
        if veth.returncode != 0:
            return "cannot make a veth pair (no veth support in this kernel?): " + veth.stderr.strip()
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _remove_namespace(namespace: str) -> None:
    for pid in _ip("netns", "pids", namespace, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", namespace, check=False)


def remove_stale_namespaces() -> None:
    """Remove the namespaces of test runs that were killed before they could (ps-PID-...: PID gone)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        match = re.match(r"(ps-(\d+)-[0-9a-f]+-[ab])\b", line)
        if match and not os.path.exists(f"/proc/{match.group(2)}"):
            _remove_namespace(match.group(1))


@dataclass(frozen=True)
class Host:
    namespace: str
    interface: str  # its end of the veth pair: the name GLOO_SOCKET_IFNAME takes
    address: str

    def argv(self, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *command]

    def run(self, command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(command), capture_output=True, text=True, timeout=60)

    def start(self, name: str, pagedserve_args: list[str], log_dir: Path, env: dict[str, str] | None = None,
              ) -> "HostProcess":
        """`pagedserve ARGS` (this checkout's) on this host."""
        return HostProcess(self, name, [sys.executable, "-m", "pagedserve.cli", *pagedserve_args],
                           log_dir / f"{name}.log", env or {})

    def enter(self) -> None:
        """Move the calling thread into this host's network namespace (new sockets live there)."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.namespace}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"setns into {self.namespace}: {os.strerror(error)}")
        finally:
            os.close(fd)

    def client_pool(self, threads: int = 4) -> concurrent.futures.ThreadPoolExecutor:
        """Threads inside this host's network: run clients there (`pool.submit(fn)`)."""
        return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=self.namespace,
                                                     initializer=self.enter)


class TwoHosts:
    """Namespaces `ps-TAG-a` (10.42.0.1) and `ps-TAG-b` (10.42.0.2) on one veth link."""

    def __init__(self):
        remove_stale_namespaces()
        tag = secrets.token_hex(3)  # veth names: 15 characters at most
        self.hosts = tuple(Host(f"ps-{os.getpid()}-{tag}-{side}", f"ps{tag}{side}", f"{SUBNET}.{i}")
                           for i, side in ((1, "a"), (2, "b")))
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    @property
    def a(self) -> Host:
        return self.hosts[0]

    @property
    def b(self) -> Host:
        return self.hosts[1]

    def _create(self) -> None:
        a, b = self.hosts
        for host in self.hosts:
            _ip("netns", "add", host.namespace)
        # Made inside host a, its peer moved to host b: no link ever shows in our own namespace.
        _ip("-n", a.namespace, "link", "add", a.interface, "type", "veth", "peer", "name", b.interface)
        _ip("-n", a.namespace, "link", "set", b.interface, "netns", b.namespace)
        for host in self.hosts:
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")

    def close(self) -> None:
        """Remove both namespaces; the veth pair goes with them. Kill what still runs in them first."""
        for host in self.hosts:
            _remove_namespace(host.namespace)

    def __enter__(self) -> "TwoHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HostProcess(LoggedProcess):
    """A command in a host's namespace, in its own session, its output in a log file."""

    def __init__(self, host: Host, name: str, command: list[str], log_path: Path, env: dict[str, str]):
        self.host = host
        # `ip netns exec` execs the command: the pid is the command's own.
        super().__init__(host.argv(command), log_path, env, name=f"{name} on {host.namespace}")

    def wait_for_log(self, pattern: str, timeout: float = 120.0) -> re.Match:
        return super().wait_for_log(pattern, timeout)
