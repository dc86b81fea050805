"""The Responses API's objects as the `openai` client types them: every field
the SDK requires, ids with OpenAI's prefixes, the input items of a stored
response (GET /v1/responses/{id}/input_items), and what retrieving or
cancelling a stored response can and cannot do here (no background runs)."""
from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseItem
from pydantic import BaseModel, TypeAdapter

import openai.types.responses as sdk_types

# The SDK's stream event classes by their `type`.
EVENT_TYPES = {cls.model_fields["type"].annotation.__args__[0]: cls for cls in vars(sdk_types).values()
               if isinstance(cls, type) and issubclass(cls, BaseModel)
               and {"type", "sequence_number"} <= set(cls.model_fields)}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
         {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)


def validated_events(url: str, body: dict) -> list[dict]:
    """The stream's events, each checked against the SDK's type for it."""
    events = []
    with httpx.stream("POST", url + "/responses", json={**body, "stream": True}, timeout=30) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                event = httpx.Response(200, content=line[len("data: "):]).json()
                EVENT_TYPES[event["type"]].model_validate(event)  # strict: a missing required field fails
                events.append(event)
    return events


@pytest.mark.parametrize("fields", [{}, {"max_output_tokens": 3}])
def test_responses_and_events_are_what_the_sdk_types_require(server, fields):
    body = {"model": "tiny-model", "input": "Say hello", **fields}
    whole = httpx.post(server.api_url + "/responses", json=body, timeout=30).json()
    response = Response.model_validate(whole)  # strict, unlike the client's own parsing
    assert response.id.startswith("resp_") and response.output[0].id.startswith("msg_")
    assert response.usage.input_tokens_details.cache_write_tokens == 0
    if response.status == "completed":
        assert response.completed_at >= response.created_at
    else:
        assert response.completed_at is None
    events = validated_events(server.api_url, body)
    assert events[0]["response"]["id"].startswith("resp_")
    assert Response.model_validate(events[-1]["response"]).output_text == response.output_text


def test_function_call_items_have_openais_ids(tool_stack):
    body = {"model": "tiny-model", "input": "Weather and time in Paris?", "tools": TOOLS}
    url = str(tool_stack.client.base_url).rstrip("/")
    response = Response.model_validate(httpx.post(url + "/responses", json=body, timeout=30).json())
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 2
    assert all(call.id.startswith("fc_") and call.call_id.startswith("call_") for call in calls)
    events = validated_events(url, body)
    streamed = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert [item["call_id"][:5] for item in streamed if item["type"] == "function_call"] == ["call_"] * 2


def test_input_items_lists_what_the_response_was_made_from(client):
    first = client.responses.create(model="tiny-model", input="Say hello", instructions="Be terse.",
                                    max_output_tokens=3)
    second = client.responses.create(model="tiny-model", previous_response_id=first.id, input=[
        {"role": "developer", "content": "Be kind."}, {"role": "user", "content": [
            {"type": "input_text", "text": "And"}, {"type": "input_text", "text": "again"}]}])
    items = client.responses.input_items.list(second.id)  # newest first, as OpenAI's default
    for item in items.data:
        TypeAdapter(ResponseItem).validate_python(item.to_dict())
    assert [(item.type, item.role) for item in items.data] == [
        ("message", "user"), ("message", "developer"), ("message", "assistant"), ("message", "user")]
    assert [part.text for part in items.data[0].content] == ["And", "again"]
    assert items.data[2].id == first.output[0].id and items.data[2].content[0].text == first.output_text
    assert items.data[3].content[0].text == "Say hello"
    assert (items.first_id, items.last_id, items.has_more) == (items.data[0].id, items.data[-1].id, False)
    ascending = client.responses.input_items.list(second.id, order="asc")
    assert [item.id for item in ascending.data] == [item.id for item in reversed(items.data)]
    page = client.responses.input_items.list(second.id, limit=3)
    assert len(page.data) == 3 and page.has_more
    every = client.responses.input_items.list(second.id, limit=1)  # the client pages on with `after`
    assert [item.id for item in every] == [item.id for item in items.data]
    rest = client.responses.input_items.list(second.id, after=items.data[1].id)
    assert [item.id for item in rest.data] == [item.id for item in items.data[2:]]


def test_input_items_of_function_calls_and_their_outputs(tool_stack):
    response = tool_stack.client.responses.create(model="tiny-model", input="Weather and time in Paris?",
                                                  tools=TOOLS)
    calls = [item for item in response.output if item.type == "function_call"]
    follow_up = tool_stack.client.responses.create(
        model="tiny-model", tools=TOOLS, previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "fine"},
               {"type": "function_call_output", "call_id": calls[1].call_id,
                "output": [{"type": "output_text", "text": "14:00"}]}])
    items = tool_stack.client.responses.input_items.list(follow_up.id, order="asc").data
    for item in items:
        TypeAdapter(ResponseItem).validate_python(item.to_dict())
    assert [item.type for item in items] == ["message", "message", "function_call", "function_call",
                                             "function_call_output", "function_call_output"]
    assert [item.id for item in items[1:4]] == [item.id for item in response.output]
    assert [item.call_id for item in items[4:]] == [call.call_id for call in calls]
    assert items[4].output == "fine" and items[5].output[0].text == "14:00"


@pytest.mark.parametrize("request_kwargs, param", [
    ({"order": "sideways"}, "order"), ({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
    ({"after": "msg_unknown"}, "after"), ({"include": ["message.input_image.image_url"]}, "include")])
def test_input_items_refuses_what_it_cannot_list(client, request_kwargs, param):
    response = client.responses.create(model="tiny-model", input="Say hello", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.input_items.list(response.id, **request_kwargs)
    assert refused.value.body["param"] == param


def test_unknown_or_unstored_responses_have_no_input_items(client):
    unstored = client.responses.create(model="tiny-model", input="Say hello", max_output_tokens=2, store=False)
    for response_id in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.input_items.list(response_id)
        assert missing.value.body["code"] == "response_not_found"


def test_cancel_is_only_for_background_responses(client):
    """As vLLM's: a response that is not running in the background cannot be cancelled."""
    response = client.responses.create(model="tiny-model", input="Say hello", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.cancel(response.id)
    assert "background" in refused.value.message
    assert client.responses.retrieve(response.id).status == "incomplete"  # untouched
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.cancel("resp_unknown")
    assert missing.value.body["code"] == "response_not_found"


@pytest.mark.parametrize("request_kwargs, param", [
    ({"stream": True}, "stream"), ({"starting_after": 3}, "starting_after"),
    ({"include": ["message.output_text.logprobs"]}, "include")])
def test_retrieve_refuses_what_it_cannot_do(client, request_kwargs, param):
    response = client.responses.create(model="tiny-model", input="Say hello", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.retrieve(response.id, **request_kwargs)
    assert refused.value.body["param"] == param
