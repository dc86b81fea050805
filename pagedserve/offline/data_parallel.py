"""The offline LLM's data parallelism: replicas 1..D-1 as child processes.

With `data_parallel_size=D` the LLM's own process is replica 0; each other
replica is a whole engine (scheduler, worker group, tokenizer) in a child
process (`python -m pagedserve.offline.replica_main`), reached over a ZeroMQ
PAIR socket with typed msgspec messages (ReplicaJob, ReplicaResults). A
`generate` call splits its prompts: prompts that share their first tokens go
to the same replica (its prefix cache then serves them), and the groups are
spread so that every replica gets a near-equal share of the tokens. Each
replica pins itself to its share of the cores, as `serve`'s replicas do.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import msgspec
import zmq

from common.cli_args import engine_argv
from common.config import EngineConfig
from common.errors import InvalidRequestError
from common.protocol import MessageType, ReplicaJob
from common.sampling_params import SamplingParams
from common.transport import MessageDecoder, make_socket, recv, send
from pagedserve.offline.offline_outputs import GenerationOutput
from pagedserve.process_supervisor import _die_with_parent

AFFINITY_TOKENS = 64  # prompts whose first 64 tokens match stay together


def assign_replicas(prompts: Sequence[Sequence[int]], num_replicas: int) -> list[list[int]]:
    """Prompt indices for each replica: groups of prompts sharing their first AFFINITY_TOKENS
    tokens, largest first, each to the replica with the fewest tokens so far."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, ids in enumerate(prompts):
        groups.setdefault(tuple(ids[:AFFINITY_TOKENS]), []).append(index)
    load = [0] * num_replicas
    shares: list[list[int]] = [[] for _ in range(num_replicas)]
    for members in sorted(groups.values(), key=lambda m: -sum(len(prompts[i]) for i in m)):
        target = min(range(num_replicas), key=lambda r: (load[r], r))
        shares[target] += members
        load[target] += sum(len(prompts[i]) for i in members)
    return [sorted(share) for share in shares]


class ReplicaProcesses:
    def __init__(self, config: EngineConfig, skip_tokenizer_init: bool):
        self.size = config.data_parallel_size
        ranks = config.world_size
        self.ctx = zmq.Context.instance()
        self.directory = tempfile.mkdtemp(prefix="pagedserve-dp-")
        self.sockets, self.processes = [], []
        child = engine_argv(config.replace(data_parallel_size=1, distributed_init_method=None))
        for replica in range(1, self.size):
            address = f"ipc://{self.directory}/replica-{replica}"
            sock = make_socket(self.ctx, zmq.PAIR)
            sock.bind(address)
            self.sockets.append(sock)
            env = {**os.environ, "LOCAL_RANK": str(replica * ranks), "LOCAL_WORLD_SIZE": str(self.size * ranks)}
            self.processes.append(subprocess.Popen(
                [sys.executable, "-m", "pagedserve.offline.replica_main", "--address", address, *child,
                 *(["--skip-tokenizer-init"] if skip_tokenizer_init else [])],
                env=env, preexec_fn=_die_with_parent))
        os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", str(self.size * ranks)  # replica 0: here
        self.decoder = MessageDecoder((MessageType.REPLICA_RESULTS,))

    def submit(self, replica: int, job: ReplicaJob) -> None:
        send(self.sockets[replica - 1], job)

    def result(self, replica: int) -> list[GenerationOutput]:
        """The outputs of `replica`'s job (blocking); its error raised here."""
        sock, process = self.sockets[replica - 1], self.processes[replica - 1]
        while not sock.poll(1000):
            if process.poll() is not None:
                raise RuntimeError(f"data-parallel replica {replica} exited ({process.returncode})")
        reply = recv(sock, self.decoder)
        if reply is None:
            raise RuntimeError(f"data-parallel replica {replica} sent a malformed reply")
        if reply.error is not None:
            raise (InvalidRequestError if reply.invalid_request else RuntimeError)(reply.error)
        return msgspec.msgpack.decode(reply.outputs, type=list[GenerationOutput])

    def stop(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def run_sharded(llm, encoded: list[tuple[str | None, list[int]]], params_list: list[SamplingParams],
                use_tqdm: bool) -> list[GenerationOutput]:
    """`llm._run` over all replicas: this process runs replica 0's share meanwhile."""
    replicas: ReplicaProcesses = llm.replicas
    shares = assign_replicas([ids for _, ids in encoded], replicas.size)
    for replica, share in enumerate(shares[1:], start=1):
        replicas.submit(replica, ReplicaJob(prompts=[encoded[i][0] for i in share],
                                            prompt_token_ids=[encoded[i][1] for i in share],
                                            sampling_params=[params_list[i] for i in share]))
    request_ids = [str(next(llm._ids)) for _ in encoded]  # in prompt order, as one engine numbers them
    results: list[GenerationOutput | None] = [None] * len(encoded)
    here = llm._run_here([encoded[i] for i in shares[0]], [params_list[i] for i in shares[0]], use_tqdm,
                         [request_ids[i] for i in shares[0]])
    for index, output in zip(shares[0], here):
        results[index] = output
    for replica, share in enumerate(shares[1:], start=1):
        for index, output in zip(share, replicas.result(replica)):
            results[index] = output
    for output, request_id in zip(results, request_ids):
        output.request_id = request_id
    return results

