"""An assistant message's tool calls reach the chat template with their
arguments as objects (templates write `arguments | tojson`), as vLLM."""
from __future__ import annotations

from frontend.openai.request_bodies import ChatCompletionRequest


def call(arguments) -> dict:
    return {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def test_json_text_arguments_become_objects_and_anything_else_is_kept():
    body = ChatCompletionRequest(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris"}'), call("not json"),
                                                              call({"city": "Rome"})]},
        {"role": "tool", "tool_call_id": "call-1", "content": "21 C"}])
    messages = body.template_messages()
    assert [c["function"]["arguments"] for c in messages[1]["tool_calls"]] == [
        {"city": "Paris"}, "not json", {"city": "Rome"}]
    assert messages[2] == {"role": "tool", "content": "21 C", "tool_call_id": "call-1"}
    # The request itself is not changed.
    assert body.messages[1].tool_calls[0]["function"]["arguments"] == '{"city": "Paris"}'


def test_tools_and_documents_reach_the_template_unless_the_request_overrides_them():
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = [{"role": "user", "content": "Hi"}]
    assert ChatCompletionRequest(messages=messages, tools=tools).template_kwargs() == {"tools": tools}
    assert ChatCompletionRequest(messages=messages, tools=tools,
                                 chat_template_kwargs={"tools": None}).template_kwargs() == {"tools": None}
    assert ChatCompletionRequest(messages=messages).template_kwargs() == {}
    documents = [{"title": "Paris", "text": "Paris is the capital of France."}]
    assert ChatCompletionRequest(messages=messages, documents=documents).template_kwargs() == {"documents": documents}
