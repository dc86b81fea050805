"""Tool calling in chat completions, as vLLM does it without a tool-call parser.

- `tool_choice` "none" (the default without tools): plain text; the tools still
  reach the chat template, which may show them to the model.
- a named function ({"type": "function", "function": {"name": ...}}): the reply
  is constrained to that function's `parameters` schema and returned as one
  tool call (finish reason "stop", as vLLM).
- "required": constrained to a JSON list of {"name", "parameters"} objects,
  one or more, returned as tool calls (finish reason "tool_calls").
- "auto" (the default with tools): free text in which the model may write
  tool calls its own way; `--enable-auto-tool-choice --tool-call-parser NAME`
  names the parser that finds them (`frontend.tool_parsers.tool_parser_registry`). Without it, a
  400, as vLLM.

`parallel_tool_calls` false allows one call: "required" is constrained to a list
of exactly one, and "auto" keeps the first call the model writes (vLLM drops the
calls after the first too; the model still generates them).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequestError
from common.structured_outputs import StructuredOutputs
from frontend.api_errors import NotSupportedError
from frontend.openai.response_bodies import OpenAIBaseModel
from frontend.tool_parsers.tool_call_ids import new_tool_call_id
from frontend.tool_parsers.tool_parser_registry import TOOL_PARSERS, ToolParser


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI's


class ToolCall(OpenAIBaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the function, when named
    parser: ToolParser | None = None  # finds the calls, when auto
    single_call: bool = False  # parallel_tool_calls false: at most one call


def resolve_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: Any,
                        auto_parser: str | None = None, parallel_tool_calls: bool = True) -> ToolChoice:
    """Check `tools` and `tool_choice` together (a 400 naming the field when they
    do not fit). `auto_parser`: the server's --tool-call-parser, None when auto
    tool choice is not enabled."""
    choice = _resolve_mode(tools, tool_choice, auto_parser)
    if parallel_tool_calls or choice.mode not in ("auto", "required"):
        return choice
    return ToolChoice(choice.mode, choice.name, choice.parser, single_call=True)


def _resolve_mode(tools: list[dict[str, Any]] | None, tool_choice: Any, auto_parser: str | None) -> ToolChoice:
    names = [_tool_name(index, tool) for index, tool in enumerate(tools or [])]
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none" or (tool_choice == "auto" and not tools):
        return ToolChoice("none")
    if tool_choice == "auto" and auto_parser is not None:
        return ToolChoice("auto", parser=TOOL_PARSERS[auto_parser]())
    if tool_choice == "auto":
        raise NotSupportedError("tool_choice", '"auto" tool choice (it needs a tool-call parser for the model); '
                                               'use "required", a named function, or "none"')
    if tool_choice == "required":
        if not tools:
            raise InvalidRequestError('tool_choice "required" needs tools', param="tool_choice")
        return ToolChoice("required")
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not in tools",
                                      param="tool_choice")
        return ToolChoice("named", name)
    raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                              '"function": {"name": ...}}', param="tool_choice")


def _tool_name(index: int, tool: Any) -> str:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
        raise InvalidRequestError(f'tools[{index}] must be {{"type": "function", "function": {{...}}}}',
                                  param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"tools[{index}].function.name must be a non-empty string", param="tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequestError(f"tools[{index}].function.parameters must be a JSON schema object",
                                  param="tools")
    return name


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_call_output(tools: list[dict[str, Any]], choice: ToolChoice) -> StructuredOutputs | None:
    """The structured output that makes the model's reply a tool call (None: free text)."""
    by_name = {tool["function"]["name"]: tool for tool in tools}
    if choice.mode == "named":
        return StructuredOutputs.of("tool_choice", json=_parameters(by_name[choice.name]))
    if choice.mode == "required":
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"type": "string", "enum": [name]}, "parameters": _parameters(tool)}}
                 for name, tool in by_name.items()]
        one_or_more = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredOutputs.of("tool_choice", json={**one_or_more, "maxItems": 1} if choice.single_call
                                    else one_or_more)
    return None


def tool_calls_of(text: str, choice: ToolChoice) -> tuple[str | None, list[ToolCall]] | None:
    """The content and tool calls of a reply; None when it holds no call (a
    constrained reply that is not complete JSON: cut by max_tokens, or stopped
    by a stop string)."""
    if choice.parser is not None:
        content, parsed = choice.parser.extract(text)
        if not parsed:
            return None
        if choice.single_call:
            parsed = parsed[:1]
        return content, [ToolCall(id=choice.parser.new_call_id(),
                                  function=FunctionCall(name=call.name, arguments=call.arguments)) for call in parsed]
    if choice.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return None
        return None, [ToolCall(id=new_tool_call_id(), function=FunctionCall(name=choice.name or "", arguments=text))]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    return None, [ToolCall(id=new_tool_call_id(), function=FunctionCall(
        name=call["name"], arguments=json.dumps(call["parameters"], ensure_ascii=False))) for call in calls]


@dataclass(frozen=True, slots=True)
class ToolCallReply:
    content: str | None
    tool_calls: list[dict[str, Any]]  # as JSON
    finish_reason: str | None


def tool_call_reply(text: str, finish_reason: str | None, choice: ToolChoice) -> ToolCallReply | None:
    """For a reply that holds tool calls: its content, its `tool_calls` and the finish
    reason ("tool_calls" for "required" and "auto", as vLLM). None: the reply is plain text."""
    if choice.mode == "none":
        return None
    found = tool_calls_of(text, choice)
    if found is None:
        return None
    content, calls = found
    finish = "tool_calls" if choice.mode == "auto" or (choice.mode == "required" and finish_reason == "stop") \
        else finish_reason
    return ToolCallReply(content, [call.model_dump() for call in calls], finish)


def arguments_as_object(tool_call: dict[str, Any]) -> dict[str, Any]:
    """A tool call whose JSON-text arguments are parsed, as vLLM hands them to
    templates (which write `arguments | tojson`, and would quote a string twice)."""
    function = tool_call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return tool_call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return tool_call
    return {**tool_call, "function": {**function, "arguments": arguments}}
