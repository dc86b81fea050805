"""The tool-call parsers for `tool_choice: "auto"` (`--enable-auto-tool-choice
--tool-call-parser NAME`, as vLLM): the model writes tool calls in its own
format inside free text, and the parser finds them (`tool_parser_base`).
"""
from __future__ import annotations

import argparse

from frontend.tool_parsers.tool_parser_base import ParsedCall, ToolParser, partial_marker
from frontend.tool_parsers.tool_parser_hermes import HermesToolParser
from frontend.tool_parsers.tool_parser_llama3 import Llama3JsonToolParser
from frontend.tool_parsers.tool_parser_mistral import MistralToolParser
from frontend.tool_parsers.tool_parser_pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)}

# The --tool-call-parser help of `pagedserve serve` and `pagedserve frontend`.
TOOL_PARSERS_HELP = ("how the model writes tool calls in its text: hermes (<tool_call>{...}</tool_call>: "
                     "Hermes 2 Pro, Qwen2.5), llama3_json ({\"name\": ..., \"parameters\": {...}}: Llama 3.1-3.3), "
                     "mistral ([TOOL_CALLS]...: Mistral), pythonic ([f(x=1), ...]: Llama 3.2, Llama 4)")

__all__ = ["TOOL_PARSERS", "TOOL_PARSERS_HELP", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "ParsedCall", "PythonicToolParser", "ToolParser", "check_tool_choice_args", "partial_marker"]


def check_tool_choice_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage line for tool settings that cannot run together."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
