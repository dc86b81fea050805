"""A worker's job handling, in process, against the tokenizer used directly."""
from __future__ import annotations

from common.protocol import ChatMessage, DetokenizeJob, RenderChatJob, TokenizeJob
from common.tokenizer import apply_chat_template
from tokenizer_pool.jobs import message_to_dict, run_job

TEXT = "Hello, world! naïve café 🙂 日本語"


def test_tokenize_matches_the_tokenizer(tiny_tokenizer):
    for special in (True, False):
        reply = run_job(tiny_tokenizer, TokenizeJob(job_id="t", text=TEXT, add_special_tokens=special))
        assert reply.error is None and reply.job_id == "t"
        assert reply.token_ids == tiny_tokenizer.encode(TEXT, add_special_tokens=special)
        assert len(reply.token_ids) > 5


def test_detokenize_round_trips_and_skips_special_tokens(tiny_tokenizer):
    ids = tiny_tokenizer.encode(TEXT)
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert run_job(tiny_tokenizer, DetokenizeJob(job_id="d", token_ids=ids)).text == TEXT
    with_eos = run_job(tiny_tokenizer, DetokenizeJob(job_id="d", token_ids=[*ids, eos], skip_special_tokens=False))
    assert with_eos.text == TEXT + "<|im_end|>"
    assert run_job(tiny_tokenizer, DetokenizeJob(job_id="d", token_ids=[*ids, eos])).text == TEXT


def test_detokenize_out_of_vocabulary_is_an_error(tiny_tokenizer):
    for bad in (len(tiny_tokenizer), -1, 10**12):
        reply = run_job(tiny_tokenizer, DetokenizeJob(job_id="d", token_ids=[1, bad]))
        assert reply.error == f"token id {bad} is outside the vocabulary (size {len(tiny_tokenizer)})"


def test_render_chat_matches_apply_chat_template(tiny_tokenizer):
    messages = [ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", content=[{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}])]
    dicts = [message_to_dict(m) for m in messages]
    for gen_prompt in (True, False):
        reply = run_job(tiny_tokenizer, RenderChatJob(job_id="r", messages=messages, add_generation_prompt=gen_prompt))
        assert reply.error is None
        assert reply.token_ids == apply_chat_template(tiny_tokenizer, dicts, add_generation_prompt=gen_prompt)
        expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello\nworld<|im_end|>\n"
        assert reply.text == expected + ("<|im_start|>assistant\n" if gen_prompt else "")


def test_bad_chat_messages_are_error_replies(tiny_tokenizer):
    image = [ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])]
    reply = run_job(tiny_tokenizer, RenderChatJob(job_id="i", messages=image))
    assert reply.job_id == "i" and reply.token_ids == [] and "takes no images" in reply.error
    reply = run_job(tiny_tokenizer, RenderChatJob(job_id="e", messages=[]))
    assert reply.error == "messages must be a non-empty list"
    reply = run_job(tiny_tokenizer, RenderChatJob(job_id="k", messages=[ChatMessage(role="user", content="x")],
                                                  chat_template_kwargs={"tokenize": True}))
    assert "chat_template_kwargs may not set ['tokenize']" in reply.error


def test_template_runtime_error_is_an_error_reply(tiny_tokenizer_dir):
    from common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    tokenizer.chat_template = "{{ raise_exception('no system messages here') }}"
    reply = run_job(tokenizer, RenderChatJob(job_id="x", messages=[ChatMessage(role="user", content="hi")]))
    assert "no system messages here" in reply.error


def test_message_to_dict_keeps_only_set_optional_fields():
    assert message_to_dict(ChatMessage(role="user", content="hi")) == {"role": "user", "content": "hi"}
    tool = ChatMessage(role="assistant", tool_calls=[{"id": "1"}])
    assert message_to_dict(tool) == {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}
