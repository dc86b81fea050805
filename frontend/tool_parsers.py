"""The tool-call parsers for `tool_choice: "auto"` (`--enable-auto-tool-choice
--tool-call-parser NAME`, as vLLM): the model writes tool calls in its own
format inside free text, and the parser finds them (`tool_parser_base`).
"""
from __future__ import annotations

from frontend.tool_parser_base import ParsedCall, ToolParser, partial_marker
from frontend.tool_parser_hermes import HermesToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (HermesToolParser,)}

__all__ = ["TOOL_PARSERS", "HermesToolParser", "ParsedCall", "ToolParser", "partial_marker"]
