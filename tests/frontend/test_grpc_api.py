"""The client gRPC API (proto/pagedserve.proto) through the generated stub."""
import grpc
import openai
import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc
from tests.frontend.conftest import MAX_MODEL_LEN, SERVED_NAMES

PROMPT = "Say hello to me."


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_address) as channel:
        yield pagedserve_pb2_grpc.PagedServeStub(channel)


def generate(stub, **fields) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=30))


def test_text_prompt_matches_the_http_api(server, stub):
    responses = generate(stub, text=PROMPT, sampling_params=pb.SamplingParams(max_tokens=5))
    http = openai.OpenAI(base_url=server.api_url, api_key="x").completions.create(
        model="tiny-model", prompt=PROMPT, max_tokens=5)
    assert "".join(r.text for r in responses) == http.choices[0].text
    assert [t for r in responses for t in r.token_ids] == server.scheduler.script[:5]
    *partial, last = responses
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not r.HasField("usage") for r in partial)
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    prompt_tokens = len(server.tokenizer.encode(PROMPT))
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (
        prompt_tokens, 5, prompt_tokens + 5)
    assert last.usage.cached_tokens == prompt_tokens // 2
    assert len({r.request_id for r in responses}) == 1


def test_token_ids_and_chat_prompts(server, stub):
    ids = server.tokenizer.encode(PROMPT)
    responses = generate(stub, request_id="grpc-ids", token_ids=pb.TokenIds(ids=ids),
                         sampling_params=pb.SamplingParams(max_tokens=2))
    assert responses[0].request_id == "grpc-ids"
    sent = next(r for r in server.scheduler.snapshot().requests if r.request_id == "grpc-ids")
    assert sent.prompt_token_ids == ids
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=PROMPT)])
    responses = generate(stub, chat=chat, sampling_params=pb.SamplingParams(temperature=0))
    assert "".join(r.text for r in responses) == server.tokenizer.decode(server.scheduler.script)
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    template = server.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                    add_generation_prompt=True)
    assert responses[-1].usage.prompt_tokens == len(server.tokenizer.encode(template, add_special_tokens=False))


@pytest.mark.parametrize("best_of", [None, 3])
def test_the_first_message_carries_the_prompt_that_ran(server, stub, best_of):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=PROMPT)])
    responses = generate(stub, request_id=f"grpc-prompt-{best_of}", chat=chat, sampling_params=pb.SamplingParams(
        max_tokens=3, n=2, best_of=best_of, truncate_prompt_tokens=4))
    sent = next(r for r in server.scheduler.snapshot().requests if r.request_id == f"grpc-prompt-{best_of}")
    assert list(responses[0].prompt_token_ids) == sent.prompt_token_ids and len(sent.prompt_token_ids) == 4
    assert not any(r.prompt_token_ids for r in responses[1:])


def test_stop_string(server, stub):
    responses = generate(stub, request_id="grpc-stop", text=PROMPT,
                         sampling_params=pb.SamplingParams(stop=["! How"]))
    assert "".join(r.text for r in responses) == " Hello, world"
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    assert responses[-1].stop_str == "! How"
    assert server.scheduler.wait_for(lambda r: "grpc-stop" in r.aborts)


@pytest.mark.parametrize("fields, code, fragment", [
    (dict(text=PROMPT, sampling_params=pb.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT,
     "temperature"),
    (dict(text=PROMPT, sampling_params=pb.SamplingParams(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(sampling_params=pb.SamplingParams(max_tokens=3)), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (dict(token_ids=pb.TokenIds(ids=[5] * (MAX_MODEL_LEN + 1))), grpc.StatusCode.INVALID_ARGUMENT,
     str(MAX_MODEL_LEN)),
    (dict(token_ids=pb.TokenIds(ids=[])), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (dict(model="gpt-4", text=PROMPT), grpc.StatusCode.NOT_FOUND, "gpt-4"),
])
def test_invalid_requests(server, stub, fields, code, fragment):
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, **fields)
    assert info.value.code() == code
    assert fragment in info.value.details()


def test_cancelled_stream_aborts_the_request(server, stub):
    call = stub.Generate(pb.GenerateRequest(request_id="grpc-cancelled",
                                            token_ids=pb.TokenIds(ids=[server.slow_token, 5])), timeout=30)
    first = next(call)
    assert first.token_ids
    call.cancel()
    assert server.scheduler.wait_for(lambda r: "grpc-cancelled" in r.aborts)


def test_tokenize(server, stub):
    reply = stub.Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=30)
    assert list(reply.token_ids) == server.tokenizer.encode(PROMPT)
    assert reply.count == len(reply.token_ids)
    assert reply.max_model_len == MAX_MODEL_LEN
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=PROMPT)])
    reply = stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=30)
    template = server.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                    add_generation_prompt=True)
    assert list(reply.token_ids) == server.tokenizer.encode(template, add_special_tokens=False)
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(pb.TokenizeRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_detokenize(server, stub):
    ids = server.tokenizer.encode(PROMPT) + [server.eos_token_id]
    reply = stub.Detokenize(pb.DetokenizeRequest(model=SERVED_NAMES[1], token_ids=ids), timeout=30)
    assert reply.text == PROMPT + "<|im_end|>"  # special tokens kept, as HTTP /detokenize does
    vocab_size = len(server.tokenizer)
    for request, code, fragment in [
            (pb.DetokenizeRequest(token_ids=[0, vocab_size]), grpc.StatusCode.INVALID_ARGUMENT,
             f"token_ids[1] = {vocab_size}"),
            (pb.DetokenizeRequest(model="gpt-4o", token_ids=[1]), grpc.StatusCode.NOT_FOUND, "gpt-4o")]:
        with pytest.raises(grpc.RpcError) as info:
            stub.Detokenize(request, timeout=30)
        assert info.value.code() == code and fragment in info.value.details()


def test_list_models_and_health(server, stub):
    models = stub.ListModels(pb.ListModelsRequest(), timeout=30).models
    assert [m.id for m in models] == SERVED_NAMES
    assert all(m.max_model_len == MAX_MODEL_LEN and m.owned_by == "pagedserve" for m in models)
    assert stub.Health(pb.HealthRequest(), timeout=30).ok
    server.control.healthy = False
    try:
        health = stub.Health(pb.HealthRequest(), timeout=30)
        assert not health.ok and health.message == "no worker"
    finally:
        server.control.healthy = True


def test_chat_template_kwargs_keep_whole_numbers_whole():
    """A protobuf Struct carries every number as a double; a template's `range(n)`
    or `{{ n }}` needs the int the client wrote."""
    from google.protobuf import struct_pb2

    from frontend.grpc.grpc_server import template_kwargs_from_proto

    struct = struct_pb2.Struct()
    struct.update({"n": 3, "ratio": 0.5, "enable_thinking": False, "nested": {"sizes": [1, 2.5]}, "name": "x"})
    kwargs = template_kwargs_from_proto(struct)
    assert kwargs == {"n": 3, "ratio": 0.5, "enable_thinking": False, "nested": {"sizes": [1, 2.5]}, "name": "x"}
    assert type(kwargs["n"]) is int and type(kwargs["nested"]["sizes"][0]) is int
    assert type(kwargs["enable_thinking"]) is bool
