"""Structured outputs in the offline engine, on a tiny random Llama with the
default model's tokenizer (random weights never follow a format by luck):
greedy output equals transformers' `generate` with xgrammar's own logits
processor token for token, the text follows the grammar (also when sampling,
and across preemption), and bad specs are clear errors."""
from __future__ import annotations

import json
import re

import pytest
import torch

from common.errors import InvalidRequestError
from common.sampling_params import SamplingParams
from common.structured_outputs import StructuredOutputs, build_grammar
from test_llm_correctness import assert_no_leaked_blocks
from tiny_models import build_tiny_llama_with_smollm2_tokenizer
from pagedserve.offline.llm import LLM

EOS = 2  # <|im_end|> in SmolLM2's tokenizer
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
SPECS = {
    "json": StructuredOutputs.of("x", json=SCHEMA),
    "json_object": StructuredOutputs(json_object=True),
    "regex": StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"),
    "choice": StructuredOutputs(choice=["yes", "no", "maybe so"]),
    "grammar": StructuredOutputs(grammar='root ::= "(" digit+ ("+" digit+)* ")"\ndigit ::= [0-9]'),
}
PROMPTS = ["Tell me about a person:", "The answer is", "Hello"]


def follows(spec: StructuredOutputs, text: str) -> bool:
    if spec.json is not None:
        value = json.loads(text)
        return set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 8
    if spec.json_object:
        return isinstance(json.loads(text), dict)
    if spec.regex is not None:
        return re.fullmatch(spec.regex, text) is not None
    if spec.choice is not None:
        return text in spec.choice
    return re.fullmatch(r"\(\d+(\+\d+)*\)", text) is not None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-smollm2-tokenizer")
    return directory, build_tiny_llama_with_smollm2_tokenizer(directory)


def make_llm(directory, **overrides) -> LLM:
    # Eager: compiling takes a minute here, and the masks act after the forward anyway.
    settings = dict(dtype="float32", device="cpu", attention_backend="torch", block_size=4,
                    num_gpu_blocks_override=400, seed=0, enforce_eager=True)
    return LLM(model=str(directory), **{**settings, **overrides})


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir[0])


def reference(hf_model, tokenizer_dir, prompt_ids: list[int], spec: StructuredOutputs, max_tokens: int) -> list[int]:
    """transformers' greedy generate under xgrammar's logits processor."""
    import xgrammar
    from xgrammar.contrib.hf import LogitsProcessor

    from common.tokenizer import load_tokenizer

    info = xgrammar.TokenizerInfo.from_huggingface(load_tokenizer(str(tokenizer_dir)), vocab_size=49152,
                                                   stop_token_ids=[EOS])
    compiled = xgrammar.GrammarCompiler(info).compile_grammar(build_grammar(spec))
    hf_model.generation_config.eos_token_id = EOS
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                logits_processor=[LogitsProcessor(compiled)])
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_greedy_equals_transformers_with_xgrammar(model_dir, llm, kind):
    directory, hf_model = model_dir
    spec = SPECS[kind]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.token_ids == reference(hf_model, directory, output.prompt_token_ids, spec, 40)
        if completion.finish_reason == "stop":  # the grammar ended (a length finish may cut it)
            assert follows(spec, completion.text), completion.text


def test_sampled_outputs_follow_the_grammar_in_a_mixed_batch(llm):
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=12)
    constrained = [SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=spec)
                   for seed, spec in enumerate(SPECS.values())]
    outputs = llm.generate(["Say something:"] * (len(constrained) + 1), [free, *constrained], use_tqdm=False)
    for spec, output in zip(SPECS.values(), outputs[1:]):
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            assert follows(spec, completion.text), (spec.kind, completion.text)
        else:  # cut by max_tokens: still a prefix the grammar allows, so no stray token
            assert spec.kind in ("json", "json_object", "grammar"), (spec.kind, completion.text)
    # The choice and regex grammars are short: they always end within max_tokens.
    assert {outputs[3].outputs[0].finish_reason, outputs[4].outputs[0].finish_reason} == {"stop"}


def test_preemption_keeps_the_constraint(model_dir, llm):
    """A pool too small for all requests at once preempts (and recomputes) some:
    their matchers are rebuilt from the outputs so far, and outputs do not change."""
    spec = SPECS["json"]  # outputs run to max_tokens here: the pool cannot hold them all
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=spec)
    prompts = [f"Count {i}:" for i in range(6)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    small = make_llm(model_dir[0], num_gpu_blocks_override=24, max_num_batched_tokens=16)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert small.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_no_leaked_blocks(small)


@pytest.mark.parametrize("fields, message", [
    ({"json": '{"type": 5}'}, "invalid json"),
    ({"json": "not json"}, "invalid json"),
    ({"regex": "("}, "invalid regex"),
    ({"grammar": "root ::= undefined_rule"}, "invalid grammar"),
    ({"grammar": 'start ::= "a"'}, "root"),
])
def test_an_invalid_spec_is_a_clear_error(llm, fields, message):
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputs(**fields))
    with pytest.raises(InvalidRequestError, match=message) as raised:
        llm.generate(["Hi"], params, use_tqdm=False)
    assert raised.value.param == "structured_outputs"


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "non-empty list"),
    ({"json": 3}, "JSON schema"),
    ({"regex": ""}, "non-empty string"),
    ({"json_object": "yes"}, "must be true"),
    ({"jsonschema": {}}, "unknown field"),
])
def test_a_malformed_spec_names_the_field(fields, message):
    with pytest.raises(InvalidRequestError, match=message) as raised:
        StructuredOutputs.of("response_format", **fields)
    assert raised.value.param == "response_format"


def test_a_grammar_the_worker_cannot_build_leaves_the_request_unconstrained(model_dir, caplog):
    """The worker never fails a step (and every request in it) over one request's grammar."""
    llm = make_llm(model_dir[0])
    llm.worker.input_batch.grammar_compiler = None
    params = SamplingParams(temperature=0, max_tokens=5, structured_outputs=SPECS["choice"])
    with caplog.at_level("ERROR"):
        [output] = llm.generate(["Hi"], params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 5  # free text, not one of the choices
    assert any("generating without it" in r.getMessage() for r in caplog.records)


def test_the_worker_prepares_grammars_in_the_background_when_it_starts(llm):
    """The tokenizer info every grammar needs (about a second for this vocabulary) is
    built while the worker starts, not inside the step of the first structured request."""
    compiler = llm.worker.grammar_compiler
    assert compiler is llm.worker.input_batch.grammar_compiler
    assert compiler.wait_for_warm_up(timeout_s=60)
    matcher = compiler.matcher(SPECS["choice"], "r0")
    assert matcher.active


def test_a_process_that_exits_during_the_warm_up_exits_cleanly():
    """Exiting while the warm-up thread was inside xgrammar's native code aborted the
    process (SIGABRT); the interpreter now waits for the warm-up, which has ended by
    the time atexit handlers run."""
    import subprocess
    import sys
    from pathlib import Path
    from common.model_files import resolve_model_dir

    child = f"""
import atexit
from worker.structured_output import GrammarCompiler
compiler = GrammarCompiler({str(resolve_model_dir('smollm2-135m-instruct'))!r}, 49152, [{EOS}])
atexit.register(lambda: print("ready at exit:", compiler.ready, flush=True))
compiler.start_warm_up()
"""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", child], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ready at exit: True" in proc.stdout
