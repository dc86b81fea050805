"""Write a SmolLM2-135M-shaped Llama with random weights whose heads split evenly in two.

SmolLM2-135M has 9 query and 3 key/value heads: pagedserve splits them 2 + 1
over two tensor-parallel ranks, but vLLM requires the head counts to divide
by the tensor-parallel size. This model keeps SmolLM2's width, depth, MLP,
vocabulary and tokenizer (hidden 576, 30 layers, MLP 1536, 49,152 tokens) with
8 query and 4 key/value heads of 64, so both engines can run it at TP=1 and
TP=2 (docs/benchmarks.md). Random weights: fine for speed (every benchmark
runs greedy with ignore_eos), meaningless text.

    .venv/bin/python scripts/make_tp_bench_model.py [DIR]   # prints DIR
"""
import os
import shutil
import sys

import torch
import transformers

from common.model_files import resolve_model_dir


def main() -> None:
    target = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/pagedserve/models/smollm2-shape-8h")
    if not os.path.exists(os.path.join(target, "config.json")):
        source = resolve_model_dir("smollm2-135m-instruct")
        config = transformers.AutoConfig.from_pretrained(source)
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 4, 64
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(target)
        for name in os.listdir(source):
            if name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config", "vocab",
                                "merges")):
                shutil.copy(os.path.join(source, name), os.path.join(target, name))
    print(target)


if __name__ == "__main__":
    main()
