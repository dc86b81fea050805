"""A frontend with --enable-auto-tool-choice --tool-call-parser hermes in front
of a fake scheduler whose model writes `REPLY` (Hermes-style tool calls after
some text), or another text for the length of a `replying` block."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import openai

from tests.frontend.conftest import Process, Server, start_frontend
from tests.frontend.fakes import FakeControl, FakeScheduler, free_port

REPLY = ('Let me check both. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]


@dataclass
class ToolStack:
    client: openai.OpenAI
    scheduler: FakeScheduler
    control: FakeControl
    frontend: Process
    tokenizer: object

    @contextmanager
    def replying(self, text: str) -> Iterator[None]:
        """The fake model writes `text` (then EOS) to the requests sent in the block."""
        self.scheduler.script = self.tokenizer.encode(text)
        try:
            yield
        finally:
            self.scheduler.script = self.tokenizer.encode(REPLY)

    def stop(self) -> None:
        self.frontend.stop()
        self.control.stop()
        self.scheduler.stop()


def start_tool_stack(server: Server, tmp: Path) -> ToolStack:
    scheduler = FakeScheduler(f"tcp://127.0.0.1:{free_port()}", server.tokenizer.encode(REPLY),
                              server.eos_token_id).start()
    control_address = f"127.0.0.1:{free_port()}"
    control = FakeControl(256, len(server.tokenizer)).start(control_address)
    args = list(server.frontend_args)
    args[args.index("--scheduler-address") + 1] = scheduler.address
    args[args.index("--scheduler-control-address") + 1] = control_address
    try:
        frontend, base_url, _ = start_frontend([*args, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                                               tmp / "frontend.log")
    except BaseException:
        control.stop()
        scheduler.stop()
        raise
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    return ToolStack(client, scheduler, control, frontend, server.tokenizer)
