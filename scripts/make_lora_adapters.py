"""Write rank-R PEFT LoRA adapters with random weights for a Hugging Face model directory
(the LoRA benchmark's adapters; docs/benchmarks.md): one per seed, on every supported module.

    .venv/bin/python scripts/make_lora_adapters.py MODEL_DIR OUT_DIR [--count 4] [--rank 16]

prints the `--lora-modules` arguments (name=path) for `pagedserve bench throughput`."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()

    import transformers
    from peft import LoraConfig, get_peft_model

    # Only the adapter's shapes come from the base: a randomly initialised model of its config will do.
    config = transformers.AutoConfig.from_pretrained(args.model_dir)
    modules = []
    for i in range(args.count):
        base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0,
                          bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(base, lora)
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():  # PEFT starts B at zero (a no-op adapter): both random, small
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(0.02 * torch.randn(param.shape, generator=generator))
        directory = Path(args.out_dir) / f"lora{i}"
        model.save_pretrained(directory)
        modules.append(f"lora{i}={directory}")
    print(" ".join(modules))


if __name__ == "__main__":
    main()
