"""Tiny random-weight transformers models saved as HF directories (tests import this module)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, rms_norm_eps=1e-5)

# Mixture-of-experts settings (merged by callers): 4 experts, top-2, experts narrower than
# the dense MLP; Qwen2-MoE's shared expert wider.
MOE_SIZES = {
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2),
    "Qwen2MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                shared_expert_intermediate_size=80),
    "Qwen3MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48),
}


def routing_margins(model, tokens: torch.Tensor) -> torch.Tensor:
    """For each MoE layer of transformers' `model` run on `tokens` [1, T], each token's gap
    between its k-th and (k+1)-th router probability (in float32): a near tie would let
    rounding choose another expert and make a comparison with the reference flaky."""
    margins: list[torch.Tensor] = []

    def record(module, _inputs, output):
        probs = torch.softmax(output[0].float(), dim=-1).sort(dim=-1, descending=True).values
        margins.append(probs[:, module.top_k - 1] - probs[:, module.top_k])

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    hooks = [m.register_forward_hook(record) for m in routers]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    assert routers and margins, "not a mixture-of-experts model"
    return torch.cat(margins)


# Config classes whose names do not follow "<Name>ForCausalLM" -> "<Name>Config".
CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}


def build_tiny_hf_model(architecture: str, directory: Path, *, seed: int = 0,
                        attn_implementation: str | None = None, **overrides: Any):
    """A random float32 transformers model (Llama, Mistral, Qwen2, Qwen3, Phi3, Gemma2, Gemma3,
    the MoE ones with `MOE_SIZES`: `<Name>ForCausalLM`) saved to `directory`; returns the model
    in eval mode. Attention: "sdpa", except Gemma's "eager" (transformers' only attention that
    applies Gemma 2's logit soft-capping on CPU).

    Weights use initializer_range 0.2 (logits spread over a few units, no argmax
    ties) and norm weights/biases are randomised too (HF initialises them to 1/0,
    which would hide mistakes in their use).
    """
    import transformers

    config_class = getattr(transformers, CONFIG_CLASSES.get(architecture, architecture.replace("ForCausalLM", "Config")))
    if attn_implementation is None:
        attn_implementation = "eager" if architecture.startswith("Gemma") else "sdpa"
    settings = {**TINY_SIZES, "initializer_range": 0.2, **overrides}
    if architecture == "Qwen2ForCausalLM":
        settings.pop("head_dim")  # Qwen2 derives it: hidden_size // num_attention_heads
    if architecture == "Phi3ForCausalLM":  # Phi3Config's special ids (32000) lie outside the tiny vocabulary
        settings = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **settings}
    config = config_class(**settings)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    # Mixture-of-experts models: the modeling code's own experts loop ("eager"), whose
    # rounding ours follows, not the grouped matmul transformers would pick by default.
    experts = {"experts_implementation": "eager"} if "num_experts_per_tok" in settings else {}
    model = getattr(transformers, architecture)._from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32, **experts)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.3 * torch.randn_like(param) if "norm" in name else 0.3 * torch.randn_like(param))
    model.eval()
    model.save_pretrained(directory)
    return model


def build_tiny_llama_with_smollm2_tokenizer(directory: Path, **overrides: Any):
    """A tiny random Llama that reads and writes text with the default model's
    tokenizer (and chat template): vocabulary 49,152, <|im_end|> (2) its EOS."""
    import shutil

    from common.model_files import resolve_model_dir

    tokenizer_dir = resolve_model_dir("smollm2-135m-instruct")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{tokenizer_dir}/{name}", directory / name)
    return build_tiny_hf_model("LlamaForCausalLM", directory, vocab_size=49152, eos_token_id=2,
                               bos_token_id=1, tie_word_embeddings=True, **overrides)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate` for one prompt, never stopping early."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def tiny_llama_engine(directory: Path, **engine_overrides: Any):
    """(transformers' tiny random Llama, the offline engine on it): float32 on CPU,
    torch attention, 4-token blocks, no tokenizer (prompts are token ids)."""
    from pagedserve.offline.llm import LLM

    hf_model = build_tiny_hf_model("LlamaForCausalLM", directory)
    settings = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", attention_backend="torch",
                    block_size=4, seed=0)
    return hf_model, LLM(model=str(directory), **{**settings, **engine_overrides})


def save_perturbed(model, directory: Path, scale: float, seed: int = 1) -> None:
    """Add noise of `scale` times each weight's mean magnitude to `model` and save it to
    `directory`: a draft model that agrees with the original often, not always."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * param.abs().mean() * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
