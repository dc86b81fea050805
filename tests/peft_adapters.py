"""PEFT LoRA adapters with random weights for the tiny test models, and transformers + peft
references to compare the engine's LoRA outputs with."""
from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


def build_peft_adapter(base_dir: Path, directory: Path, *, rank: int, targets: list[str], seed: int,
                       alpha: int = 16, scale: float = 0.3, use_rslora: bool = False) -> None:
    """Save a LoRA adapter of the model at `base_dir` to `directory`, in PEFT's format.
    Both A and B random (PEFT starts B at zero, which would make the adapter a no-op)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                        use_rslora=use_rslora, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)


def peft_reference(base_dir: Path, adapter_dir: Path | None):
    """transformers' model at `base_dir` with the adapter at `adapter_dir` (None: the base alone)."""
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir)
    return model.eval()
