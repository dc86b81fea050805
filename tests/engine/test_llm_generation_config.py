"""The offline LLM's default sampling parameters follow the model's
generation_config.json (vLLM's LLM.get_default_sampling_params)."""
from __future__ import annotations

import json

from tiny_models import build_tiny_hf_model, hf_greedy
from pagedserve.offline.llm import LLM


def test_generate_without_params_uses_the_models_recommendation(tmp_path):
    hf_model = build_tiny_hf_model("LlamaForCausalLM", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 50}))
    settings = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", attention_backend="torch",
                    block_size=4, num_gpu_blocks_override=64, enforce_eager=True)
    llm = LLM(model=str(tmp_path), **settings)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k) == (0.0, 0)
    prompt = [5, 17, 99, 42, 7]
    [output] = llm.generate([prompt], use_tqdm=False)  # greedy, as the file recommends
    completion = output.outputs[0]
    assert completion.token_ids == hf_greedy(hf_model, prompt, 16)[:len(completion.token_ids)]
    assert LLM(model=str(tmp_path), generation_config="vllm", **settings).get_default_sampling_params().temperature == 1.0
