"""The pool as real processes: router + 2 spawned workers, a client over TCP."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import zmq

from common.errors import InvalidRequestError
from common.protocol import ChatMessage, TokenizeJob, TokenizerReady, TokenizerReply
from common.tokenizer import apply_chat_template
from common.transport import MessageDecoder, MessageType, encode
from tokenizer_pool.tokenizer_client import TokenizerClient
from tokenizer_pool.pool_errors import TokenizerUnavailableError
from tokenizer_pool.pool import local_connect_address

from tokenizer_pool_helpers import CORPUS, cmdline, cpu_ticks, launch_pool

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_tokenizer_dir):
    pool = launch_pool(tmp_path_factory.mktemp("pool"), ["--model", tiny_tokenizer_dir, "--tokenizer-pool-size", "2"])
    assert pool.wait_for_log(r"joined the pool \(2 workers\)", timeout=60), pool.log()
    yield pool
    pool.stop()


def ask(pool, make_coro, **client_kwargs):
    async def go():
        async with TokenizerClient(pool.frontend, timeout=30, **client_kwargs) as client:
            return await make_coro(client)
    return asyncio.run(go())


def test_encode_decode_render_match_the_tokenizer(pool, tiny_tokenizer):
    text = "Hello, world! naïve café 🙂"
    messages = [{"role": "system", "content": "Be brief."}, ChatMessage(role="user", content="How are you?")]

    async def calls(client):
        return await asyncio.gather(
            client.encode(text), client.encode(text, add_special_tokens=False),
            client.decode(tiny_tokenizer.encode(text)),
            client.render_chat(messages), client.render_chat(messages, add_generation_prompt=False),
            client.render_chat_reply(messages))

    ids, ids_plain, decoded, chat, chat_no_prompt, chat_reply = ask(pool, calls)
    as_dicts = [messages[0], {"role": "user", "content": "How are you?"}]
    assert ids == tiny_tokenizer.encode(text) and ids_plain == tiny_tokenizer.encode(text, add_special_tokens=False)
    assert decoded == text
    assert chat == apply_chat_template(tiny_tokenizer, as_dicts)
    assert chat_no_prompt == apply_chat_template(tiny_tokenizer, as_dicts, add_generation_prompt=False)
    assert chat_reply.token_ids == chat
    assert chat_reply.text.endswith("<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n")


def test_many_concurrent_jobs_all_answered_correctly(pool, tiny_tokenizer):
    rng = random.Random(0)
    texts = [" ".join(rng.choices(CORPUS, k=rng.randint(1, 4))) + f" #{i}" for i in range(400)]

    async def calls(client):
        ids = await asyncio.gather(*(client.encode(t) for t in texts))
        back = await asyncio.gather(*(client.decode(i) for i in ids))
        return ids, back

    ids, back = ask(pool, calls)
    assert ids == [tiny_tokenizer.encode(t) for t in texts]
    assert back == texts


def test_two_clients_may_use_the_same_job_ids(pool, tiny_tokenizer):
    """The router renames jobs, so equal ids from different frontends never mix."""
    ctx = zmq.Context.instance()
    socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
    try:
        for sock, text in zip(socks, ("first client", "second client")):
            sock.connect(pool.frontend)
            sock.send_multipart(encode(TokenizeJob(job_id="same", text=text)))
        decoder = MessageDecoder([MessageType.TOKENIZER_REPLY])
        for sock, text in zip(socks, ("first client", "second client")):
            assert sock.poll(20_000)
            reply = decoder.decode(sock.recv_multipart())
            assert (reply.job_id, reply.token_ids) == ("same", tiny_tokenizer.encode(text))
    finally:
        for sock in socks:
            sock.close(linger=0)


def test_bad_frames_are_dropped_and_logged(pool, tiny_tokenizer):
    ctx = zmq.Context.instance()
    front, back = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        front.connect(pool.frontend)
        back.connect(pool.backend)
        front.send_multipart([b"\x00\xffgarbage"])
        front.send_multipart([bytes([MessageType.TOKENIZE]), b"\xc1not msgpack"])
        front.send_multipart(encode(TokenizerReady(worker_id="confused")))  # a worker message on the client side
        back.send_multipart([b"garbage", b"more", b"frames"])
        back.send_multipart(encode(TokenizeJob(job_id="x", text="a job sent to the worker side")))
        back.send_multipart(encode(TokenizerReply(job_id="nobody-asked", token_ids=[1])))  # ignored
        # a worker that announces itself but is not reachable under that name
        back.send_multipart(encode(TokenizerReady(worker_id="ghost")))
        assert pool.wait_for_log(r"dropped a bad frame", count=5), pool.log()
        assert ask(pool, lambda c: asyncio.gather(*(c.encode("still works") for _ in range(8)))) == \
            [tiny_tokenizer.encode("still works")] * 8
    finally:
        front.close(linger=0)
        back.close(linger=0)
    log = pool.log()
    assert "unexpected message type 34" in log and "unexpected message type 30" in log
    assert "undecodable TOKENIZE" in log and "expected 2 frames" in log
    assert "Traceback" not in log


def test_bad_chat_messages_are_errors_and_the_pool_keeps_serving(pool, tiny_tokenizer):
    image = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                          {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]

    async def calls(client):
        errors = []
        for bad in (image, [], [{"content": "no role"}]):
            with pytest.raises(InvalidRequestError) as info:
                await client.render_chat(bad)
            errors.append(info.value.message)
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await client.decode([1, 10**9])
        return errors, await client.render_chat([{"role": "user", "content": "fine"}])

    errors, ok = ask(pool, calls)
    assert "takes no images" in errors[0]  # a text-only model's pool
    assert errors[1] == "messages must be a non-empty list"
    assert "invalid chat message" in errors[2]  # refused by the client before sending
    assert ok == apply_chat_template(tiny_tokenizer, [{"role": "user", "content": "fine"}])
    assert len(pool.workers()) == 2


def test_process_titles(pool):
    assert cmdline(pool.pid) == "pagedserve: tokenizer"
    assert sorted(cmdline(pid) for pid in pool.workers()) == ["pagedserve: tokenizer 1", "pagedserve: tokenizer 2"]


def test_client_times_out_when_nobody_answers():
    async def go():
        async with TokenizerClient("tcp://127.0.0.1:9", resend_interval=0.1, timeout=0.35) as client:
            with pytest.raises(TokenizerUnavailableError, match="did not answer within 0.35s"):
                await client.encode("hello")
    asyncio.run(go())


def test_idle_pool_sleeps(pool):
    """No busy polling: an idle router and idle workers use almost no CPU
    (heartbeats only)."""
    pids = [pool.pid, *pool.workers()]
    before = [cpu_ticks(pid) for pid in pids]
    time.sleep(2.0)
    used = [cpu_ticks(pid) - b for pid, b in zip(pids, before)]
    assert all(ticks <= 10 for ticks in used), used  # clock ticks (1/100 s) in 2 s


def test_local_workers_reach_a_wildcard_bind_over_loopback():
    assert local_connect_address("tcp://0.0.0.0:5557") == "tcp://127.0.0.1:5557"
    assert local_connect_address("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert local_connect_address("tcp://10.0.0.5:5557") == "tcp://10.0.0.5:5557"
    assert local_connect_address("ipc:///run/pagedserve/tok") == "ipc:///run/pagedserve/tok"


def test_chat_add_special_tokens_adds_the_tokenizers_own_on_top_of_the_template(tmp_path):
    """vLLM's chat `add_special_tokens`: off by default (the template writes its own),
    on asks the tokenizer for its BOS as well, here one whose post-processor adds it."""
    import json

    from common.tokenizer import load_tokenizer
    from tokenizer_pool_helpers import build_tiny_tokenizer

    directory = build_tiny_tokenizer(tmp_path / "bos-tokenizer")
    config = json.loads((directory / "tokenizer.json").read_text())
    bos = next(token["id"] for token in config["added_tokens"] if token["content"] == "<|endoftext|>")
    config["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [bos], "tokens": ["<|endoftext|>"]}}}
    (directory / "tokenizer.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(str(directory))
    messages = [{"role": "user", "content": "How are you?"}]
    pool = launch_pool(tmp_path, ["--model", str(directory), "--tokenizer-pool-size", "1"])
    try:
        assert pool.wait_for_log(r"joined the pool \(1 workers\)", timeout=60), pool.log()
        plain, special = ask(pool, lambda client: asyncio.gather(
            client.render_chat(messages), client.render_chat(messages, add_special_tokens=True)))
    finally:
        pool.stop()
    assert plain == apply_chat_template(tokenizer, messages) and plain[0] != bos
    assert special == [bos, *plain]
