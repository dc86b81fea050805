"""Tiny random-weight vision-language models (LLaVA) saved with their processor (no Hub download)."""
from __future__ import annotations

import io
import shutil
from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32  # pixels a side after the processor's resize/crop
PATCH_SIZE = 8  # -> (32 / 8)^2 = 16 image tokens (CLS dropped)


def build_tiny_llava(directory: Path, *, seed: int = 0):
    """A random float32 LlavaForConditionalGeneration (tiny CLIP vision tower, tiny Llama text
    model with the default model's tokenizer plus an `<image>` token) and its LlavaProcessor,
    both saved to `directory`; returns (model, processor)."""
    import transformers
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from common.model_files import resolve_model_dir
    from tests.tiny_models import TINY_SIZES

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = resolve_model_dir("smollm2-135m-instruct")
    staging = directory / "_tokenizer"
    staging.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tokenizer_dir}/{name}", staging / name)
    tokenizer = AutoTokenizer.from_pretrained(staging, local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    shutil.rmtree(staging)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(**{**TINY_SIZES, "vocab_size": image_token_id + 8, "initializer_range": 0.2,
                          "eos_token_id": 2, "bos_token_id": 1})
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         projector_hidden_act="gelu")
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.3 * torch.randn_like(param) if "norm" in name else 0.3 * torch.randn_like(param))
            elif "vision_tower" in name or "projector" in name:
                param.normal_(0.0, 0.2)
    model.eval()
    model.save_pretrained(directory)
    image_processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                         crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                               vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                               num_additional_image_tokens=1)
    processor.save_pretrained(directory)
    del transformers
    return model, processor


def random_image(seed: int, size: tuple[int, int] = (40, 36)):
    """A PIL RGB image of random pixels."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
