"""Default internal addresses; each can be set by flag or PAGEDSERVE_* environment variable."""
from __future__ import annotations

import os

DEFAULTS = {
    "SCHEDULER_ADDRESS": "tcp://127.0.0.1:5555",  # frontends -> scheduler (ZMQ)
    "TOKENIZER_ADDRESS": "tcp://127.0.0.1:5556",  # frontends -> tokenizer router (ZMQ)
    "TOKENIZER_BACKEND_ADDRESS": "tcp://127.0.0.1:5557",  # tokenizer processes -> router (ZMQ)
    "WORKER_ADDRESS": "tcp://127.0.0.1:5558",  # workers -> scheduler (ZMQ)
    "SCHEDULER_CONTROL_ADDRESS": "127.0.0.1:50052",  # scheduler control service (gRPC)
}


def default_address(name: str) -> str:
    return os.environ.get(f"PAGEDSERVE_{name}", DEFAULTS[name])
