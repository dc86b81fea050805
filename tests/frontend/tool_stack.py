"""A frontend with --enable-auto-tool-choice --tool-call-parser NAME in front of
a fake scheduler whose model writes the parser's `Format.reply` (tool calls, after
some text where the format has content), or another text for the length of a
`replying` block. The frontend's tokenizer is the test server's with the format's
markers added as special tokens, as in the models that use the format."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import openai

from tests.frontend.conftest import Process, Server, start_frontend
from local_ports import free_port
from tests.frontend.fakes import FakeControl, FakeScheduler

REPLY = ('Let me check both. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Weather and time in Paris?"}]
WEATHER, TIME = {"city": "Paris", "unit": "celsius"}, {"timezone": "CET"}


@dataclass(frozen=True)
class Format:
    """How a parser's model writes the two calls get_weather(WEATHER) and get_time(TIME)."""
    parser: str
    reply: str
    content: str | None  # the reply's text before its calls
    malformed: str  # calls that are not well formed, the first one before its name is complete
    plain: str  # text that only looks like the start of a call
    special_tokens: list[str] = field(default_factory=list)
    calls: list[tuple[str, dict]] = field(default_factory=lambda: [("get_weather", WEATHER), ("get_time", TIME)])


FORMATS = {
    "hermes": Format("hermes", REPLY, "Let me check both. ",
                     'Sure. <tool_call>\nget_weather(city="Paris")\n</tool_call>', "Compare a <tool b.",
                     calls=[("get_weather", {"city": "Paris"}), ("get_time", TIME)]),
    "llama3_json": Format(
        "llama3_json", 'Let me check both. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                       '"unit": "celsius"}}; {"name": "get_time", "parameters": {"timezone": "CET"}}',
        "Let me check both. ", 'Sure. {"name": get_weather, "parameters": {"city": "Paris"}}',
        'Fill in {"city": "Paris"} and send it.', special_tokens=["<|python_tag|>"]),
    "mistral": Format(
        "mistral", 'Let me check both.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
                   '"unit": "celsius"}}, {"name": "get_time", "arguments": {"timezone": "CET"}}]',
        "Let me check both.", 'Sure.[TOOL_CALLS][{"name": get_weather, "arguments": {"city": "Paris"}}]',
        "Answer in [TOOL form] please.", special_tokens=["[TOOL_CALLS]", "[ARGS]"]),
    "mistral_v11": Format(
        "mistral", 'Let me check both.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                   '[TOOL_CALLS]get_time[ARGS]{"timezone": "CET"}',
        "Let me check both.", 'Sure.[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}',
        "Answer in [TOOL form] please.", special_tokens=["[TOOL_CALLS]", "[ARGS]"]),
    "pythonic": Format(
        "pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(timezone="CET")]', None,
        "[get_weather(city=Paris)]", "[1] Paris is sunny."),
}


@dataclass
class ToolStack:
    client: openai.OpenAI
    scheduler: FakeScheduler
    control: FakeControl
    frontend: Process
    tokenizer: object
    reply: str

    @contextmanager
    def replying(self, text: str) -> Iterator[None]:
        """The fake model writes `text` (then EOS) to the requests sent in the block."""
        self.scheduler.script = self.tokenizer.encode(text)
        try:
            yield
        finally:
            self.scheduler.script = self.tokenizer.encode(self.reply)

    def stop(self) -> None:
        self.frontend.stop()
        self.control.stop()
        self.scheduler.stop()


def start_tool_stack(server: Server, tmp: Path, parser: str = "hermes") -> ToolStack:
    """A stack for `parser`, its fake model writing the reply of the parser's first format."""
    form = next(form for form in FORMATS.values() if form.parser == parser)
    args = list(server.frontend_args)
    tokenizer = server.tokenizer
    if form.special_tokens:
        tokenizer = _with_special_tokens(args[args.index("--model") + 1], form.special_tokens, tmp / "tokenizer")
        args[args.index("--model") + 1] = str(tmp / "tokenizer")
    scheduler = FakeScheduler(f"tcp://127.0.0.1:{free_port()}", tokenizer.encode(form.reply),
                              server.eos_token_id).start()
    control_address = f"127.0.0.1:{free_port()}"
    control = FakeControl(256, len(tokenizer)).start(control_address)
    args[args.index("--scheduler-address") + 1] = scheduler.address
    args[args.index("--scheduler-control-address") + 1] = control_address
    try:
        frontend, base_url, _ = start_frontend([*args, "--enable-auto-tool-choice", "--tool-call-parser", parser],
                                               tmp / "frontend.log")
    except BaseException:
        control.stop()
        scheduler.stop()
        raise
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    return ToolStack(client, scheduler, control, frontend, tokenizer, form.reply)


def _with_special_tokens(model_dir: str, tokens: list[str], path: Path):
    """The test tokenizer plus `tokens` as special tokens (new ids after the others),
    saved to `path` for the frontend."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.save_pretrained(str(path))
    return tokenizer
