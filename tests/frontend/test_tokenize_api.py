"""/tokenize and /detokenize through the real frontend and tokenizer pool,
checked against the tokenizer itself and against what generation counts."""
import json

import httpx
import openai
import pytest

from tests.frontend.conftest import MAX_MODEL_LEN

TEXT = "naïve café — 日本語 🙂 Hello, world!"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello to me."}]


def post(server, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes to ASCII, so a lone surrogate reaches the server as JSON spells it.
    return httpx.post(server.base_url + path, content=json.dumps(body), timeout=30,
                      headers={"content-type": "application/json"})


def test_tokenize_a_prompt_as_the_tokenizer_does(server):
    reply = post(server, "/tokenize", {"model": "tiny-model", "prompt": TEXT, "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    expected = server.tokenizer.encode(TEXT)
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == server.tokenizer.convert_ids_to_tokens(expected)
    plain = post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert plain["tokens"] == server.tokenizer.encode(TEXT, add_special_tokens=False)
    assert plain["token_strs"] is None


def test_tokenize_messages_counts_what_a_chat_completion_uses(server):
    body = post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert body["tokens"] == server.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                  tokenize=True, return_dict=False)
    client = openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0)
    chat = client.chat.completions.create(model="tiny-model", messages=MESSAGES, max_tokens=2)
    assert chat.usage.prompt_tokens == body["count"]
    without_prompt = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without_prompt["count"] < body["count"]
    assert body["tokens"][:without_prompt["count"]] == without_prompt["tokens"]


def test_detokenize_gives_back_the_text_with_special_tokens(server):
    ids = server.tokenizer.encode(TEXT) + [server.eos_token_id]
    reply = post(server, "/detokenize", {"model": "tiny-alias", "tokens": ids})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": TEXT + "<|im_end|>"}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"prompt": ["not", "a", "string"]}, 400, "prompt"),
    ("/tokenize", {"prompt": "bad \ud800 text"}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": "maybe"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"model": "gpt-4o", "prompt": "hi"}, 404, "model"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1 << 70]}, 400, "tokens"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-4o", "tokens": [1]}, 404, "model"),
])
def test_bad_bodies_get_openai_errors(server, path, body, status, param):
    reply = post(server, path, body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_detokenize_refuses_ids_beyond_the_vocabulary(server):
    vocab_size = len(server.tokenizer)
    reply = post(server, "/detokenize", {"tokens": [0, vocab_size]})
    assert reply.status_code == 400
    assert f"tokens[1] = {vocab_size}" in reply.json()["error"]["message"]
    assert post(server, "/detokenize", {"tokens": [vocab_size - 1]}).status_code == 200
