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
