"""POST /v1/responses (OpenAI's Responses API) with the official `openai`
client, in front of the fake scheduler: the prompt is the chat the request
describes, the reply comes back as output items (whole or as the API's
stream events), stored responses continue a conversation and can be
retrieved and deleted, and what is not supported is a 400 naming the field."""
from __future__ import annotations

import json

import openai
import pytest

from tests.frontend.tool_stack import REPLY

INSTRUCTIONS = "You are terse."


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)


def rendered(server, messages) -> list[int]:
    text = server.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return server.tokenizer.encode(text, add_special_tokens=False)


def sent_prompt(server, response_id: str) -> list[int]:
    server.scheduler.wait_for(lambda r: any(q.request_id == response_id for q in r.requests))
    return next(r for r in server.scheduler.snapshot().requests if r.request_id == response_id).prompt_token_ids


def script_text(server, num_tokens: int | None = None) -> str:
    return server.tokenizer.decode(server.scheduler.script[:num_tokens])


def test_a_response_is_the_chat_the_request_describes(server, client):
    response = client.responses.create(model="tiny-model", instructions=INSTRUCTIONS, input="Say hello")
    assert response.object == "response" and response.status == "completed" and response.model == "tiny-model"
    assert sent_prompt(server, response.id) == rendered(
        server, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Say hello"}])
    [message] = response.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert response.output_text == script_text(server)
    usage = response.usage
    assert usage.output_tokens == len(server.scheduler.script) + 1  # and the EOS
    assert usage.input_tokens == len(sent_prompt(server, response.id))
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.instructions == INSTRUCTIONS and response.store is True


def test_max_output_tokens_makes_it_incomplete(client, server):
    response = client.responses.create(model="tiny-model", input="Say hello", max_output_tokens=4)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == script_text(server, 4) and response.usage.output_tokens == 4


def test_input_items_become_the_chat(server, client):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                              {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": "Again"}]
    response = client.responses.create(model="tiny-model", input=items)
    assert sent_prompt(server, response.id) == rendered(server, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}])


def test_the_stream_sends_the_apis_events_and_adds_up_to_the_whole(server, client):
    whole = client.responses.create(model="tiny-model", input="Say hello")
    events = list(client.responses.create(model="tiny-model", input="Say hello", stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.output[0].id == events[2].item.id == events[-2].item.id


def test_the_openai_stream_helper_builds_the_response(client):
    whole = client.responses.create(model="tiny-model", input="Say hello")
    with client.responses.stream(model="tiny-model", input="Say hello") as stream:
        text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == whole.output_text
    assert final.status == "completed" and final.id != whole.id


def test_a_stream_cut_by_max_output_tokens_ends_with_response_incomplete(client, server):
    events = list(client.responses.create(model="tiny-model", input="Say hello", max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete"  # as OpenAI's (the SDK's helper then has no final response)
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == script_text(server, 5)


def test_previous_response_id_continues_the_conversation(server, client):
    first = client.responses.create(model="tiny-model", instructions=INSTRUCTIONS, input="Say hello",
                                    max_output_tokens=3)
    second = client.responses.create(model="tiny-model", input="And again", previous_response_id=first.id)
    # The earlier turns carry over; the earlier instructions do not (as OpenAI's).
    assert sent_prompt(server, second.id) == rendered(server, [
        {"role": "user", "content": "Say hello"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And again"}])
    assert second.previous_response_id == first.id
    third = client.responses.create(model="tiny-model", input="Once more", previous_response_id=second.id,
                                    instructions="New rules.")
    third_prompt = server.tokenizer.decode(sent_prompt(server, third.id))
    assert third_prompt.startswith("<|im_start|>system\nNew rules.<|im_end|>") and INSTRUCTIONS not in third_prompt
    assert third_prompt.count("Say hello") == third_prompt.count("And again") == 1


def test_stored_responses_are_retrieved_and_deleted(client):
    response = client.responses.create(model="tiny-model", input="Say hello", max_output_tokens=3)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="tiny-model", input="Hi", previous_response_id=response.id)
    assert missing.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="tiny-model", input="Say hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("request_fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input"),
    ({"background": True}, "background"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"model": "other-model"}, "model"),
    ({"extra_body": {"top_k": "many"}}, "top_k"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    # Chat completion fields a response does not take: sent here, they would be ignored.
    ({"extra_body": {"max_tokens": 5}}, "max_tokens"),
    ({"extra_body": {"response_format": {"type": "json_object"}}}, "response_format"),
    ({"extra_body": {"messages": [{"role": "user", "content": "Hi"}]}}, "messages"),
    ({"extra_body": {"n": 2}}, "n"),
    ({"extra_body": {"logprobs": True}}, "logprobs"),
    ({"extra_body": {"logit_bias": {"5": 10}}}, "logit_bias"),
    ({"extra_body": {"guided_regex": "a+"}}, "guided_regex"),
    ({"extra_body": {"stream_options": {"include_usage": True}}}, "stream_options"),
    ({"extra_body": {"structural_tag": "{}"}}, "structural_tag"),
    # OpenAI's metadata limits.
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
])
def test_what_cannot_run_is_a_400_naming_the_field(client, request_fields, param):
    request = {"model": "tiny-model", "input": "Hi", **request_fields}
    with pytest.raises(openai.APIStatusError) as refused:
        client.responses.create(**request)
    assert refused.value.status_code in (400, 404) and refused.value.body["param"] == param


@pytest.mark.parametrize("request_fields, param", [
    ({"max_output_tokens": 0}, "max_output_tokens"), ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "Hello, world! " * 200}, "input")])  # too long for the context (256 tokens)
def test_errors_speak_of_the_responses_fields(client, request_fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"model": "tiny-model", "input": "Hi", "max_output_tokens": 8, **request_fields})
    assert refused.value.body["param"] == param
    assert "max_output_tokens" in refused.value.message and "max_tokens" not in refused.value.message \
        and "max_completion_tokens" not in refused.value.message


def test_metadata_at_openais_limits_is_kept(client):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    response = client.responses.create(model="tiny-model", input="Hi", max_output_tokens=2, metadata=metadata)
    assert response.metadata == metadata == client.responses.retrieve(response.id).metadata


def test_max_tool_calls_bounds_built_in_tools_only_so_it_is_echoed(client):
    response = client.responses.create(model="tiny-model", input="Hi", max_output_tokens=2, max_tool_calls=2)
    assert response.max_tool_calls == 2 and response.output_text
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny-model", input="Hi", max_output_tokens=2, max_tool_calls=0)
    assert refused.value.body["param"] == "max_tool_calls"


def test_parallel_tool_calls_false_is_echoed(client):
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    for fields in ({}, {"tools": [tool], "tool_choice": "none"},
                   {"tools": [tool], "tool_choice": {"type": "function", "name": "get_weather"}}):
        response = client.responses.create(model="tiny-model", input="Hi", max_output_tokens=2,
                                           parallel_tool_calls=False, **fields)
        assert response.parallel_tool_calls is False


def test_function_calls_come_back_as_items_whole_and_streamed(tool_stack):
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
             {"type": "function", "name": "get_time", "parameters": {"type": "object"}}]
    request = dict(model="tiny-model", input="Weather and time in Paris?", tools=tools)
    response = tool_stack.client.responses.create(**request)
    message, *calls = response.output
    assert message.type == "message" and response.output_text == REPLY[:REPLY.index("<tool_call>")]
    assert [(call.type, call.name, json.loads(call.arguments)) for call in calls] == [
        ("function_call", "get_weather", {"city": "Paris"}), ("function_call", "get_time", {"timezone": "CET"})]
    assert all(call.call_id.startswith("call_") for call in calls)
    with tool_stack.client.responses.stream(**request) as stream:
        streamed = stream.get_final_response()
    assert [(item.type, getattr(item, "arguments", None)) for item in streamed.output] == \
        [(item.type, getattr(item, "arguments", None)) for item in response.output]
    # The call's result goes back as function_call_output, after the call itself.
    follow_up = tool_stack.client.responses.create(
        model="tiny-model", tools=tools, previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"},
               {"type": "function_call_output", "call_id": calls[1].call_id, "output": "14:00"}])
    assert follow_up.status == "completed"
    prompt = tool_stack.tokenizer.decode(next(r for r in tool_stack.scheduler.snapshot().requests
                                              if r.request_id == follow_up.id).prompt_token_ids)
    assert prompt.count("Weather and time in Paris?") == 1 and "21 C" in prompt and "14:00" in prompt


def test_a_failure_after_the_stream_started_is_an_error_event(server, client):
    rejected = server.tokenizer.decode([server.reject_token])  # the fake scheduler refuses prompts holding it
    with pytest.raises(openai.BadRequestError, match="rejected"):
        client.responses.create(model="tiny-model", input=f"Say {rejected}")
    events = list(client.responses.create(model="tiny-model", input=f"Say {rejected}", stream=True))
    assert events[0].type == "response.created" and events[-1].type == "error"
    assert "rejected" in events[-1].message and events[-1].code == "400"
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_the_response_reports_the_sampling_values_used(client):
    """As OpenAI and vLLM: the values the model ran with, not null for "unset"."""
    default = client.responses.create(model="tiny-model", input="Say hello", max_output_tokens=2)
    assert (default.temperature, default.top_p) == (1.0, 1.0)
    chosen = client.responses.create(model="tiny-model", input="Say hello", max_output_tokens=2, temperature=0.3,
                                     top_p=0.9)
    assert (chosen.temperature, chosen.top_p) == (0.3, 0.9)
    assert default.tool_choice == "auto" and default.tools == []  # OpenAI's echo of the defaults
