"""Tool-call parsers for tool_choice "auto" (`--tool-call-parser NAME`): each
finds the calls a model writes in its own format inside free text
(`tool_parser_registry` lists them)."""
