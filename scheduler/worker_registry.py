"""Which worker the scheduler plans for, and what to make of each hello.

One worker is registered at a time. Any other worker that says hello stands
by; when the registered one is lost, a standby worker is promoted at once
(or the next worker to say hello takes over). A replacement must serve the
same model shape while requests are waiting for it.
Every registration starts a new session, so a worker can tell that the
requests it holds belong to a session that is over.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from common.protocol import PROTOCOL_VERSION, WorkerHello

# What must match for a new worker to take over the requests of a lost one.
WORKER_SHAPE = ("model_name", "num_blocks", "block_size", "max_model_len", "vocab_size", "eos_token_ids", "pooler")


class Verdict(enum.Enum):
    SAME = "same"  # the registered worker said hello again
    FIRST = "first"  # no worker ever registered (or the shape changed while idle): start afresh
    REPLACEMENT = "replacement"  # takes over from a lost worker, same shape
    STANDBY = "standby"  # another worker is registered and alive
    REFUSED = "refused"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    message: str = ""


class WorkerRegistry:
    def __init__(self, scheduler_id: str):
        self.scheduler_id = scheduler_id
        self.identity: bytes | None = None  # the registered worker; None while there is none
        self.hello: WorkerHello | None = None  # the model's shape, kept while a worker is replaced
        self.session = 0
        self.standby: dict[bytes, WorkerHello] = {}  # connected workers waiting to take over

    @property
    def session_id(self) -> str:
        return f"{self.scheduler_id}.{self.session}"

    def judge(self, peer: bytes, hello: WorkerHello, has_requests: bool) -> Decision:
        if hello.protocol_version != PROTOCOL_VERSION:
            return Decision(Verdict.REFUSED, f"protocol version {hello.protocol_version}, the scheduler speaks "
                                             f"{PROTOCOL_VERSION}")
        if peer == self.identity:
            return Decision(Verdict.SAME)
        if self.identity is not None:
            # A second worker for the same replica (tensor parallel) is not supported yet.
            return Decision(Verdict.STANDBY, f"worker {peer_name(self.identity)} is registered; standing by")
        if self.hello is None:
            return Decision(Verdict.FIRST)
        if shape(hello) == shape(self.hello):
            return Decision(Verdict.REPLACEMENT)
        if not has_requests:
            return Decision(Verdict.FIRST)
        return Decision(Verdict.REFUSED, (
            f"this worker's model or KV cache shape differs from the lost worker's ({shape(hello)} vs "
            f"{shape(self.hello)}) and requests are waiting for that shape; restart the scheduler to change it"))

    def register(self, peer: bytes, hello: WorkerHello) -> None:
        self.identity, self.hello = peer, hello
        self.standby.pop(peer, None)
        self.session += 1

    def lose(self) -> bytes | None:
        peer, self.identity = self.identity, None
        return peer


class CrashLedger:
    """Worker deaths charged to the requests of the step that was running:
    a request charged `limit` times is probably what kills workers (a poison
    request) and should be failed rather than handed to the next one."""

    def __init__(self, limit: int = 2):
        self.limit = limit
        self.deaths: dict[str, int] = {}  # request id -> worker deaths during its steps

    def charge(self, request_ids: list[str]) -> list[str]:
        """Charge a death to each request (client ids: the samples of one request
        are charged once); return those at the limit."""
        over = []
        for request_id in dict.fromkeys(request_ids):
            self.deaths[request_id] = self.deaths.get(request_id, 0) + 1
            if self.deaths[request_id] >= self.limit:
                over.append(request_id)
        return over

    def forget(self, request_id: str) -> None:
        self.deaths.pop(request_id, None)


def peer_name(identity: bytes) -> str:
    """A peer identity for logs: its text when printable (workers and frontends name themselves)."""
    text = identity.decode("ascii", "replace")
    return text if identity.isascii() and text.isprintable() else identity.hex()


def shape(hello: WorkerHello) -> dict:
    return {name: getattr(hello, name) for name in WORKER_SHAPE}
