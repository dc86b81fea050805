"""`LLM.chat` in the offline engine: the model's chat template (or one given
per call, as vLLM's `chat_template=`) makes the prompt, and the reply is the
same as generating from that prompt's ids."""
from __future__ import annotations

import pytest

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from tiny_models import build_tiny_llama_with_smollm2_tokenizer
from pagedserve.offline.llm import LLM

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-smollm2-tokenizer")
    build_tiny_llama_with_smollm2_tokenizer(directory)
    return LLM(model=str(directory), dtype="float32", device="cpu", attention_backend="torch", block_size=4,
               num_gpu_blocks_override=200, seed=0, enforce_eager=True)


def test_chat_renders_the_models_template_and_generates_from_it(llm):
    [chat] = llm.chat(MESSAGES, GREEDY, use_tqdm=False)
    expected = llm.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat.prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)
    [plain] = llm.generate([{"prompt_token_ids": chat.prompt_token_ids}], GREEDY, use_tqdm=False)
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


def test_a_chat_template_per_call_replaces_the_models(llm):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[bot]"
    [chat] = llm.chat(MESSAGES, GREEDY, use_tqdm=False, chat_template=template)
    assert llm.tokenizer.decode(chat.prompt_token_ids) == "[system] Be brief.\n[user] Hi there\n[bot]"
    [again] = llm.chat(MESSAGES, GREEDY, use_tqdm=False)  # the model's own is untouched
    assert llm.tokenizer.decode(again.prompt_token_ids).startswith("<|im_start|>system")


def test_several_conversations_and_a_broken_message(llm):
    outputs = llm.chat([MESSAGES, MESSAGES[1:]], GREEDY, use_tqdm=False)
    assert len(outputs) == 2 and outputs[0].prompt_token_ids != outputs[1].prompt_token_ids
    with pytest.raises(InvalidRequestError, match="role"):
        llm.chat([{"content": "no role"}], GREEDY, use_tqdm=False)
