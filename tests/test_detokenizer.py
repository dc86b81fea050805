"""Tokenizer helpers (common.tokenizer) and IncrementalDetokenizer, whose
deltas, joined, must equal a one-shot decode.

Uses SmolLM2's byte-level BPE tokenizer (converted once per session, shared
with test_model_files.py through the same cache dir) and a tiny SentencePiece
style tokenizer built in memory for the leading-space case.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.detokenizer import IncrementalDetokenizer
from common.errors import ConfigError, InvalidRequestError
from common.model_files import resolve_model_dir
from common.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer, render_chat_prompt

MIXED_TEXT = "Hello 世界! 🎉🎊 naïve café — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, 한국어, العربية, 👩‍👩‍👧 family\n\tdone."


def shared_cache_dir(tmp_path_factory) -> str:
    return os.environ.get("PAGEDSERVE_CACHE_DIR") or str(tmp_path_factory.getbasetemp() / "pagedserve-models")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return resolve_model_dir("smollm2-135m-instruct", shared_cache_dir(tmp_path_factory))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    """Feed `ids` in chunks of the given sizes (cycled); return every delta, flush included."""
    deltas, start, index = [], 0, 0
    while start < len(ids):
        size = chunks[index % len(chunks)] if chunks else 1
        deltas.append(detokenizer.add_tokens(ids[start:start + size]))
        start, index = start + size, index + 1
    deltas.append(detokenizer.flush())
    return deltas


def test_mixed_script_text_round_trips_one_token_at_a_time(tokenizer):
    ids = tokenizer.encode(MIXED_TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add_tokens([token]) for token in ids]
    assert "".join(deltas) == detokenizer.text == MIXED_TEXT
    assert detokenizer.flush() == ""
    assert all("\ufffd" not in delta for delta in deltas)
    # Some characters span several tokens: those steps emit nothing, then the whole character.
    assert deltas.count("") > 0 and "世" in deltas and "🎉" in "".join(deltas[:deltas.index(" 🎉") + 1])
    assert detokenizer.output_token_ids == ids


def test_split_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # the emoji's four bytes come as several tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.add_tokens([token]) for token in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.add_tokens(ids[-1:]) == "🎉"


def test_flush_drops_bytes_that_never_complete(tokenizer):
    # As vLLM: a request ending inside a character (max_tokens) does not end in U+FFFD.
    partial = tokenizer.encode("🎉")[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add_tokens(partial) == ""
    assert detokenizer.flush() == "" and detokenizer.text == ""


def test_flush_keeps_whole_characters_held_with_an_unfinished_one(tokenizer):
    ids = tokenizer.encode("ok 🎉")
    space_and_lead = next(i for i, t in enumerate(ids) if tokenizer.decode([t]) == " \ufffd")
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.add_tokens(ids[:space_and_lead]) == "ok"
    assert detokenizer.add_tokens(ids[space_and_lead:-1]) == ""  # " " waits with the emoji's first bytes
    assert detokenizer.flush() == " " and detokenizer.text == "ok "


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_or_kept(tokenizer, skip):
    ids = tokenizer.encode("<|im_start|>assistant\nHi there<|im_end|><|endoftext|>")
    assert ids[0] == 1 and ids[-2:] == [2, 0]
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    text = "".join(stream(detokenizer, ids, [1]))
    expected = "assistant\nHi there" if skip else "<|im_start|>assistant\nHi there<|im_end|><|endoftext|>"
    assert text == expected == tokenizer.decode(ids, skip_special_tokens=skip)


def test_prompt_context_does_not_leak_into_the_output(tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\n日本語で<|im_end|>\n<|im_start|>assistant\n")
    output = tokenizer.encode("はい、🎉 okay")
    for skip in (True, False):
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt, skip_special_tokens=skip)
        assert "".join(stream(detokenizer, output, [1])) == "はい、🎉 okay"
        assert detokenizer.output_token_ids == output


def test_prompt_ending_inside_a_character_is_not_used_as_context(tokenizer):
    lead_byte, trail_byte = tokenizer.convert_tokens_to_ids(["Â", "¡"])  # UTF-8 of "¡" is C2 A1
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=[100, lead_byte])
    text = "".join(stream(detokenizer, [trail_byte, 100], [1]))
    assert text == tokenizer.decode([trail_byte, 100]) == "\ufffd" + tokenizer.decode([100])


class _CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call gets."""

    def __init__(self, tokenizer):
        self.window_sizes: list[int] = []
        backend, sizes = tokenizer.backend_tokenizer, self.window_sizes

        class Backend:
            def decode(self, ids, skip_special_tokens):
                sizes.append(len(ids))
                return backend.decode(ids, skip_special_tokens=skip_special_tokens)
        self.backend_tokenizer = Backend()


def test_each_step_decodes_a_short_window_not_the_whole_output(tokenizer):
    ids = tokenizer.encode(MIXED_TEXT * 30)
    counting = _CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, prompt_token_ids=list(range(100, 200)))
    assert "".join(stream(detokenizer, ids, [1])) == MIXED_TEXT * 30
    assert len(ids) > 1000 and max(counting.window_sizes) <= 8


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_token_sequences_match_one_shot_decode(tokenizer, data):
    vocab = len(tokenizer)
    token = st.one_of(st.integers(0, 16), st.integers(0, vocab - 1), st.integers(17, 300))  # specials, any, bytes
    ids = data.draw(st.lists(token, min_size=0, max_size=60), label="ids")
    prompt = data.draw(st.none() | st.lists(token, max_size=10), label="prompt")
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5), label="chunks")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt, skip_special_tokens=skip)
    deltas = stream(detokenizer, ids, chunks)
    expected = tokenizer.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")  # an unfinished end is dropped
    assert "".join(deltas) == detokenizer.text == expected
    assert all(not delta.endswith("\ufffd") for delta in deltas)


def sentencepiece_style_tokenizer():
    """A tiny Metaspace tokenizer: like Llama-2's, decoding drops the space
    of the first token, which is what the prompt context is for."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "▁world": 4, "!": 5, "▁": 6}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_leading_space_kept_after_a_prompt():
    tokenizer = sentencepiece_style_tokenizer()
    prompt, output = [1, 3], [4, 5]  # "<s> Hello" then " world!"
    assert tokenizer.decode(output) == "world!"  # alone, the leading space goes
    with_prompt = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    assert "".join(stream(with_prompt, output, [1])) == " world!"
    full, prompt_text = tokenizer.decode(prompt + output), tokenizer.decode(prompt)
    assert with_prompt.text == full[len(prompt_text):]
    without_prompt = IncrementalDetokenizer(tokenizer)
    assert "".join(stream(without_prompt, output, [1])) == "world!"


# --- common.tokenizer -----------------------------------------------------------------

def test_load_tokenizer_refuses_missing_or_empty_dirs(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path))


def test_eos_token_ids_from_generation_config_config_and_tokenizer(model_dir, tokenizer, tmp_path):
    assert eos_token_ids(model_dir) == eos_token_ids(model_dir, tokenizer) == [2]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(os.path.join(model_dir, name), tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    assert eos_token_ids(str(tmp_path)) == [7, 2, 9]
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}))
    assert eos_token_ids(str(tmp_path)) == [0, 2]  # config.json's, then the tokenizer's <|im_end|>


def test_chat_template_ids_match_transformers(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert apply_chat_template(tokenizer, messages) == list(expected)
    assert tokenizer.decode(apply_chat_template(tokenizer, messages)).endswith(
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = apply_chat_template(tokenizer, messages, add_generation_prompt=False)
    assert tokenizer.decode(no_prompt).endswith("2+2?<|im_end|>\n")


def test_text_parts_are_joined_and_final_message_continued(tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    assert render_chat_prompt(tokenizer, parts) == render_chat_prompt(
        tokenizer, [{"role": "user", "content": "first\nsecond"}])
    prefill = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    rendered = render_chat_prompt(tokenizer, prefill, add_generation_prompt=False, continue_final_message=True)
    assert rendered.endswith("<|im_start|>assistant\n1, 2,")


@pytest.mark.parametrize("messages, fragment", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], "must be an object"),
    ([{"content": "hi"}], "role"),
    ([{"role": "user", "content": 5}], "string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}], "image_url"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "input_audio"),
    ([{"role": "user", "content": [{"type": "text"}]}], "'text'"),
])
def test_malformed_messages_are_invalid_requests(tokenizer, messages, fragment):
    with pytest.raises(InvalidRequestError, match=fragment) as info:
        apply_chat_template(tokenizer, messages)
    assert info.value.param == "messages" and info.value.http_status == 400


def test_template_problems_are_invalid_requests(model_dir):
    tokenizer = load_tokenizer(model_dir)  # our own copy: its template gets replaced below
    hello = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match="cannot both be true") as info:
        apply_chat_template(tokenizer, hello, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="may not set") as info:
        apply_chat_template(tokenizer, hello, chat_template_kwargs={"tokenize": True})
    assert info.value.param == "chat_template_kwargs"
    tokenizer.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}"
                               "{% endif %}{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(InvalidRequestError, match="system first"):
        apply_chat_template(tokenizer, hello)
    system = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_chat_prompt(tokenizer, system, chat_template_kwargs={"greeting": "Hey. "}) == "Hey. SU"
    tokenizer.chat_template = None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        apply_chat_template(tokenizer, hello)
