"""A data-parallel replica of the offline LLM, started by its replica 0 (see data_parallel).

Builds the engine, then runs each ReplicaJob replica 0 sends over the PAIR
socket and answers with ReplicaResults, until replica 0 stops it (SIGTERM: the
engine's own worker group is then stopped in order) or goes away.
"""
from __future__ import annotations

import argparse
import signal
import sys

import msgspec
import zmq

from common.cli_args import add_engine_args, engine_config
from common.errors import InvalidRequestError
from common.protocol import MessageType, ReplicaResults
from common.transport import MessageDecoder, make_socket, recv, send


def serve_jobs(argv: list[str] | None = None) -> int:
    """A child replica: build the engine, then run each job the parent sends until it goes away."""
    parser = argparse.ArgumentParser(prog="pagedserve offline replica")
    parser.add_argument("--address", required=True)
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    from pagedserve.offline.llm import LLM

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # exit through the engine's finalizers
    llm = LLM.from_config(engine_config(args), skip_tokenizer_init=args.skip_tokenizer_init)
    sock = make_socket(zmq.Context.instance(), zmq.PAIR)
    sock.connect(args.address)
    decoder = MessageDecoder((MessageType.REPLICA_JOB,))
    while True:
        job = recv(sock, decoder)
        if job is None:
            continue
        try:
            outputs = llm._run(list(zip(job.prompts, job.prompt_token_ids)), list(job.sampling_params),
                               use_tqdm=False)
            reply = ReplicaResults(outputs=msgspec.Raw(msgspec.msgpack.encode(outputs)))
        except InvalidRequestError as e:
            reply = ReplicaResults(error=e.message, invalid_request=True)
        except Exception as e:  # reported to the caller, who raises it
            reply = ReplicaResults(error=f"{type(e).__name__}: {e}")
        send(sock, reply)


if __name__ == "__main__":
    sys.exit(serve_jobs())
