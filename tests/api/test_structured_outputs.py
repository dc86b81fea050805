"""Structured outputs through the whole process split, with the official
`openai` client and gRPC: OpenAI's response_format, vLLM's structured_outputs
and guided_* fields, streamed or not; bad specs are 400s naming the field."""
from __future__ import annotations

import json
import re

import grpc
import openai
import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from serve_helpers import MODEL

CITY_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
               "properties": {"city": {"type": "string", "maxLength": 20},
                              "country": {"type": "string", "maxLength": 20}}}
PHONE = r"[0-9]{3}-[0-9]{4}"


def test_chat_response_format_json_schema(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": CITY_SCHEMA}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    value = json.loads(choice.message.content)
    assert set(value) == {"city", "country"} and value["city"] == "Paris"


def test_chat_json_object_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris in JSON with two keys."}],
        temperature=0.7, seed=4, max_tokens=200, stream=True, response_format={"type": "json_object"})
    chunks = [chunk for chunk in stream if chunk.choices]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    # The grammar must have ended the reply (max_tokens would cut the JSON), or
    # the check below would not happen.
    assert chunks[-1].choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


def test_completion_guided_choice_and_regex(client):
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=10,
                                      extra_body={"guided_choice": ["London", "Paris", "Berlin"]})
    assert reply.choices[0].text == "Paris" and reply.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt="My phone number is", temperature=1.0, seed=1,
                                       max_tokens=20, n=2, stream=True,
                                       extra_body={"structured_outputs": {"regex": PHONE}})
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert all(re.fullmatch(PHONE, text) for text in texts), texts


def test_grpc_structured_outputs(stub):
    request = pb.GenerateRequest(text="The capital of France is", sampling_params=pb.SamplingParams(
        temperature=0, max_tokens=10, structured_outputs=pb.StructuredOutputs(choice=["London", "Paris"])))
    assert "".join(chunk.text for chunk in stub.Generate(request)) == "Paris"
    bad = pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(
        max_tokens=4, structured_outputs=pb.StructuredOutputs(regex="(")))
    with pytest.raises(grpc.RpcError) as raised:
        list(stub.Generate(bad))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid regex" in raised.value.details()


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format", "invalid json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"guided_regex": "("}, "guided_regex", "invalid regex"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "invalid grammar"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
    ({"structural_tag": "{}"}, "structural_tag", "not supported"),
])
def test_a_bad_spec_is_a_400_naming_the_field(client, body, param, message):
    for create, args in ((client.completions.create, {"prompt": "Hi"}),
                         (client.chat.completions.create, {"messages": [{"role": "user", "content": "Hi"}]})):
        with pytest.raises(openai.BadRequestError) as raised:
            create(model=MODEL, max_tokens=4, extra_body=body, **args)
        assert raised.value.body["param"] == param
        assert message in raised.value.body["message"]
