"""A streamed response that may call functions sends its items as they are
generated, as OpenAI's does: the text before the calls as output_text deltas,
then each call as its own function_call item whose arguments arrive piece by
piece (response.function_call_arguments.delta, then .done); the `openai`
client's stream helper builds the same response as the non-stream one."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.frontend.tool_stack import FORMATS, REPLY

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
         {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
ASK = dict(model="tiny-model", input="Weather and time in Paris?", tools=TOOLS)


def shape(response) -> list[tuple]:
    return [(item.type, item.status, getattr(item, "name", None), getattr(item, "arguments", None),
             item.content[0].text if item.type == "message" else None) for item in response.output]


def check_item_events(events) -> None:
    """Each item is added, then gets its deltas, then is done, before the next one starts."""
    open_item = None
    for event in events:
        if event.type == "response.output_item.added":
            assert open_item is None
            open_item = event.item.id
        elif event.type == "response.output_item.done":
            assert open_item == event.item.id
            open_item = None
        elif hasattr(event, "item_id"):
            assert event.item_id == open_item, event.type
    assert open_item is None


def test_text_then_calls_stream_as_they_are_generated(tool_stack):
    whole = tool_stack.client.responses.create(**ASK)
    events = list(tool_stack.client.responses.create(**ASK, stream=True))
    check_item_events(events)
    text = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(text) > 1 and "".join(text) == REPLY[:REPLY.index("<tool_call>")]
    added = [event.item for event in events if event.type == "response.output_item.added"]
    assert [(item.type, item.status) for item in added] == [("message", "in_progress"),
                                                             ("function_call", "in_progress"),
                                                             ("function_call", "in_progress")]
    assert [item.name for item in added[1:]] == ["get_weather", "get_time"]
    for call in added[1:]:
        pieces = [event.delta for event in events
                  if event.type == "response.function_call_arguments.delta" and event.item_id == call.id]
        [done] = [event for event in events
                  if event.type == "response.function_call_arguments.done" and event.item_id == call.id]
        assert len(pieces) > 1 and "".join(pieces) == done.arguments and done.name == call.name
    assert events[-1].type == "response.completed" and shape(events[-1].response) == shape(whole)
    with tool_stack.client.responses.stream(**ASK) as stream:
        assert shape(stream.get_final_response()) == shape(whole)


@pytest.mark.parametrize("tool_choice, reply", [
    ({"type": "function", "name": "get_weather"}, '{"city": "Paris", "unit": "C"}'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}]'),
])
def test_a_forced_call_streams_its_arguments(tool_stack, tool_choice, reply):
    with tool_stack.replying(reply):
        whole = tool_stack.client.responses.create(**ASK, tool_choice=tool_choice)
        events = list(tool_stack.client.responses.create(**ASK, tool_choice=tool_choice, stream=True))
    check_item_events(events)
    pieces = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris", "unit": "C"}
    assert shape(events[-1].response) == shape(whole) and whole.output[0].type == "function_call"


def test_a_reply_that_is_no_call_streams_as_text(tool_stack):
    with tool_stack.replying("Just some words, no call at all."):
        whole = tool_stack.client.responses.create(**ASK)
        events = list(tool_stack.client.responses.create(**ASK, stream=True))
    check_item_events(events)
    text = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(text) > 1 and "".join(text) == whole.output_text == "Just some words, no call at all."
    assert shape(events[-1].response) == shape(whole)


def test_a_call_cut_by_max_output_tokens_is_incomplete(tool_stack):
    events = list(tool_stack.client.responses.create(**ASK, max_output_tokens=20, stream=True))
    check_item_events(events)
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.output[-1].status == "incomplete"


def test_leaving_a_streamed_tool_response_aborts_it(server):
    """The fake model writes the slow prompt's reply forever: only the client leaving ends it."""
    slow = server.tokenizer.decode([server.slow_token])
    body = {"model": "tiny-model", "input": f"Say {slow}", "stream": True, "tool_choice": "required",
            "tools": TOOLS, "max_output_tokens": 200}
    with httpx.stream("POST", server.api_url + "/responses", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        created = next(line for line in lines if line.startswith("data: "))
        next(line for line in lines if "response.output_text.delta" in line)
    response_id = httpx.Response(200, content=created[len("data: "):]).json()["response"]["id"]
    assert server.scheduler.wait_for(lambda r: response_id in r.aborts), "no Abort after the client left"


@pytest.mark.parametrize("form", list(FORMATS.values()), ids=list(FORMATS))
def test_every_parsers_calls_stream_and_continue_the_conversation(tool_stacks, form):
    stack = tool_stacks(form.parser)
    with stack.replying(form.reply):
        whole = stack.client.responses.create(**ASK)
        with stack.client.responses.stream(**ASK) as stream:
            streamed = stream.get_final_response()
    calls = [item for item in whole.output if item.type == "function_call"]
    assert [(call.name, json.loads(call.arguments)) for call in calls] == form.calls
    assert shape(streamed) == shape(whole)
    if form.parser == "mistral":  # ids its chat templates accept back
        assert all(len(call.call_id) == 9 and call.call_id.isalnum() for call in calls)
    else:
        assert all(call.call_id.startswith("call_") for call in calls)
    follow_up = stack.client.responses.create(
        model="tiny-model", tools=TOOLS, previous_response_id=whole.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "fine"} for call in calls])
    assert follow_up.status == "completed"
