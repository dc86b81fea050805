"""The Responses API through the whole process split with the official `openai`
client and the real model: the same reply as the chat completion it stands for,
a JSON schema in text.format, a named function tool as a function_call item."""
from __future__ import annotations

import json

from serve_helpers import MODEL
from test_structured_outputs import CITY_SCHEMA

QUESTION = "What is the capital of France?"


def test_the_reply_is_the_chat_completions(client):
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}])
    response = client.responses.create(model=MODEL, temperature=0, max_output_tokens=12,
                                       instructions="Answer briefly.", input=QUESTION)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    events = list(client.responses.create(model=MODEL, temperature=0, max_output_tokens=12, stream=True,
                                          instructions="Answer briefly.", input=QUESTION))
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert streamed == response.output_text and events[-1].type == "response.incomplete"


def test_a_json_schema_in_text_format_streamed(client):
    with client.responses.stream(
            model=MODEL, temperature=0, max_output_tokens=60, input=QUESTION + " Answer in JSON.",
            text={"format": {"type": "json_schema", "name": "capital", "schema": CITY_SCHEMA, "strict": True}}
    ) as stream:
        response = stream.get_final_response()
    assert response.status == "completed"
    value = json.loads(response.output_text)
    assert set(value) == {"city", "country"} and value["city"] == "Paris"


def test_a_named_function_comes_back_as_a_function_call(client):
    tool = {"type": "function", "name": "get_weather", "description": "Get the weather in a city",
            "parameters": CITY_SCHEMA}
    response = client.responses.create(model=MODEL, temperature=0, max_output_tokens=60,
                                       input="What is the weather in Paris?", tools=[tool],
                                       tool_choice={"type": "function", "name": "get_weather"})
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city", "country"}


def test_a_streamed_call_and_its_output_continue_the_conversation(client):
    """A call's arguments stream piece by piece; its result continues the conversation,
    stored (previous_response_id) or sent back whole, to the same reply."""
    tool = {"type": "function", "name": "get_weather", "description": "Get the weather in a city",
            "parameters": CITY_SCHEMA}
    ask = {"model": MODEL, "temperature": 0, "tools": [tool]}
    with client.responses.stream(**ask, max_output_tokens=60, input="What is the weather in Paris?",
                                 tool_choice="required") as stream:
        pieces = [event.delta for event in stream if event.type == "response.function_call_arguments.delta"]
        response = stream.get_final_response()
    [call] = response.output
    assert len(pieces) > 1 and "".join(pieces) == call.arguments and call.call_id.startswith("call_")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C and sunny"}
    answer = {**ask, "max_output_tokens": 8, "tool_choice": "none"}  # (this server runs no "auto")
    stored = client.responses.create(**answer, previous_response_id=response.id, input=[result])
    resent = client.responses.create(**answer, store=False, input=[
        {"role": "user", "content": "What is the weather in Paris?"}, *response.output, result])
    assert stored.output_text == resent.output_text and stored.usage.input_tokens == resent.usage.input_tokens
    items = client.responses.input_items.list(stored.id, order="asc").data
    assert [item.type for item in items] == ["message", "function_call", "function_call_output"]
