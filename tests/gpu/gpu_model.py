"""The model of the GPU run: the default model's shape (SmolLM2-135M, llama) with seeded
random weights, built from the bundle's config and tokenizer files (the real GGUF does not
fit the carry limit), or a given real model directory used as it is.

Run as a script: `python tests/gpu/gpu_model.py BUNDLE_MODEL_DIR OUT_DIR [--seed N]`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from gpu_bundle import MODEL_FILES  # run with tests/gpu on sys.path (the script's own directory)

RANDOM_INIT_STD = 0.2


def build_random_model(files_dir: Path, out_dir: Path, seed: int = 0) -> dict:
    """Save a LlamaForCausalLM with the config in `files_dir` and random weights to `out_dir`
    (float32 safetensors, HF's initialisation with std RANDOM_INIT_STD under `seed`), with the
    tokenizer files."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(files_dir, local_files_only=True)
    # Weights of std 0.2 (the checkpoint's 0.02 leaves logits nearly flat): greedy comparisons
    # then meet no argmax near-ties (as tests/tiny_models.py).
    config.initializer_range = RANDOM_INIT_STD
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in MODEL_FILES:
        if name != "config.json" and (files_dir / name).exists():
            shutil.copy2(files_dir / name, out_dir / name)
    return {"architecture": config.architectures[0], "parameters": sum(p.numel() for p in model.parameters()),
            "seed": seed, "random_weights": True, "init_std": RANDOM_INIT_STD}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = build_random_model(args.files_dir, args.out_dir, args.seed)
    result["seconds"] = round(time.perf_counter() - started, 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
