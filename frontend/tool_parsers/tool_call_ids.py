"""The id of a tool call in a chat reply ("chatcmpl-tool-" and 32 hex digits, as
vLLM's), shared by the parsers, the call scanner and the chat API."""
from __future__ import annotations

import secrets


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"
