"""A model-free worker process: the real WorkerService (handshake, standby,
session resets) around tests/scheduler's FakeWorker, which checks every plan
against its own model of the KV cache. Output i of every request is token i
of a scripted cycle, so outputs are predictable, never EOS, and the same
whether or not a request was recomputed.

    python -m tests.reliability.fake_worker_main --worker-address ADDR --vocab-size V --eos E --script 5,6,7
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import time

from common.config import EngineConfig
from common.logging_setup import setup_logging
from common.proctitle import set_process_title
from common.protocol import StepPlan, StepResult, WorkerHello
from tests.scheduler.fake_worker import FakeWorker
from worker.worker_service import WorkerService


class ScriptedWorker:
    """The interface WorkerService needs from worker.worker.Worker."""
    rank = 0

    def __init__(self, args: argparse.Namespace):
        self.args = args
        script = [int(t) for t in args.script.split(",")]
        def next_token(request_id: str, token_ids: list[int]) -> int:
            # Output i of every request is script[i]: outputs depend only on their position.
            num_outputs = len(token_ids) - self.fake.requests[request_id].num_prompt_tokens
            return script[num_outputs % len(script)]
        self.fake = FakeWorker(args.num_blocks, args.block_size, vocab_size=args.vocab_size, sample_fn=next_token)

    def hello(self) -> WorkerHello:
        a = self.args
        return WorkerHello(rank=0, model_name=a.model, num_blocks=a.num_blocks, block_size=a.block_size,
                           max_model_len=a.max_model_len, vocab_size=a.vocab_size, eos_token_ids=[a.eos],
                           dtype="float32")

    @property
    def num_requests(self) -> int:
        return len(self.fake.requests)

    def reset_requests(self) -> None:
        self.fake.requests.clear()

    def execute(self, plan: StepPlan) -> StepResult:
        time.sleep(self.args.step_delay)  # a model step takes time: lets tests act mid-generation
        if self._holds(plan, self.args.crash_on_token):
            logging.getLogger(__name__).error("a poison request: dying")
            os._exit(3)  # like a segfault in a kernel: no cleanup, no goodbye
        if self._holds(plan, self.args.hang_on_token):
            logging.getLogger(__name__).error("a request that hangs the worker for %gs", self.args.hang_seconds)
            time.sleep(self.args.hang_seconds)  # like a stuck device: alive, connected, silent
        return self.fake.execute(plan)

    @staticmethod
    def _holds(plan: StepPlan, token: int | None) -> bool:
        return token is not None and any(token in new.token_ids for new in plan.new_requests)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker-address", required=True)
    parser.add_argument("--model", default="tiny-model")
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=EngineConfig().block_size)  # what the scheduler expects
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--eos", type=int, required=True)
    parser.add_argument("--script", required=True, help="comma-separated token ids to emit, in a cycle")
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--crash-on-token", type=int, default=None, help="die on a request holding this token")
    parser.add_argument("--hang-on-token", type=int, default=None, help="hang on a request holding this token")
    parser.add_argument("--hang-seconds", type=float, default=5.0)
    args = parser.parse_args()
    setup_logging("worker 0")
    set_process_title("pagedserve: worker 0")
    service = WorkerService(ScriptedWorker(args), args.worker_address)

    def stop(signum, frame):
        service.running = False
    signal.signal(signal.SIGTERM, stop)
    try:
        service.run()
    finally:
        service.close()
    logging.getLogger(__name__).info("fake worker stopped")


if __name__ == "__main__":
    main()
