"""The reply's role and chat `echo`, as vLLM's: with add_generation_prompt the
reply is the assistant's; without it the last message's turn is continued,
so the reply has that message's role and echo repeats that message — over
HTTP (streamed or not) and gRPC alike."""
from __future__ import annotations

import grpc
import openai
import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc

USER_LAST = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]
CONTINUE = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)


def script_text(server, num_tokens: int) -> str:
    return server.tokenizer.decode(server.scheduler.script[:num_tokens])


def test_continued_user_turn_is_echoed_with_the_users_role(server, client):
    response = client.chat.completions.create(model="tiny-model", messages=USER_LAST, max_tokens=3,
                                              extra_body=CONTINUE)
    message = response.choices[0].message
    assert (message.role, message.content) == ("user", "Say hello" + script_text(server, 3))
    chunks = list(client.chat.completions.create(model="tiny-model", messages=USER_LAST, max_tokens=3, stream=True,
                                                 extra_body=CONTINUE))
    assert chunks[0].choices[0].delta.role == "user"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content


def test_new_turn_is_the_assistants_and_echoes_no_user_message(server, client):
    response = client.chat.completions.create(model="tiny-model", messages=USER_LAST, max_tokens=3,
                                              extra_body={"echo": True})
    message = response.choices[0].message
    assert (message.role, message.content) == ("assistant", script_text(server, 3))


def test_grpc_echo_of_a_continued_user_turn(server):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in USER_LAST], add_generation_prompt=False,
                           continue_final_message=True)
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = pagedserve_pb2_grpc.PagedServeStub(channel)
        responses = list(stub.Generate(pb.GenerateRequest(chat=chat, echo=True, sampling_params=pb.SamplingParams(
            max_tokens=3)), timeout=30))
    assert "".join(r.text for r in responses) == "Say hello" + script_text(server, 3)
