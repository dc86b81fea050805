"""Tiny random-weight vision-language models (LLaVA, Qwen2-VL, Qwen2.5-VL) saved with their
processor (no Hub download)."""
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
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from tests.tiny_models import TINY_SIZES

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _default_tokenizer(directory)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
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


QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_PATCH = 4  # pixels a side of a patch; merge 2 -> one image token per 8x8 pixels


def build_tiny_qwen2_vl(directory: Path, *, qwen25: bool = False, seed: int = 0):
    """A random float32 Qwen2VLForConditionalGeneration (or Qwen2_5_VL...: RMSNorm/SwiGLU vision
    blocks, window attention in all but block 1) with the default model's tokenizer plus the
    vision tokens and the PIL image processor, saved to `directory`; returns (model, processor):
    transformers' Qwen2VLProcessor over the same parts, the reference of the prompt processing."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _default_tokenizer(directory)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    start, end, image, video = tokenizer.convert_tokens_to_ids(QWEN_VL_TOKENS)
    text = dict(vocab_size=len(tokenizer) + 4, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    common = dict(depth=2, num_heads=4, patch_size=QWEN_PATCH, spatial_merge_size=2, temporal_patch_size=2)
    if qwen25:
        vision = dict(common, hidden_size=32, out_hidden_size=64, intermediate_size=48, hidden_act="silu",
                      window_size=16, fullatt_block_indexes=[1])
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    else:
        vision = dict(common, embed_dim=32, hidden_size=64, mlp_ratio=2)
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    config = config_class(text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
                          vision_start_token_id=start, vision_end_token_id=end)
    config.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model = model_class._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.3 * torch.randn_like(param) if "norm" in name or "ln_q" in name
                            else 0.3 * torch.randn_like(param))
            elif "visual" in name:
                param.normal_(0.0, 0.2)
    model.eval()
    model.save_pretrained(directory)
    image_processor = Qwen2VLImageProcessorPil(size={"shortest_edge": 8 * 8, "longest_edge": 64 * 64},
                                               patch_size=QWEN_PATCH, merge_size=2, temporal_patch_size=2)
    image_processor.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, _qwen_vl_processor(image_processor, tokenizer)


def _qwen_vl_processor(image_processor, tokenizer):
    """transformers' Qwen2VLProcessor without a video processor: its constructor checks that
    one's class, which cannot load without torchvision, so the check is skipped here."""
    from unittest import mock

    from transformers.models.qwen2_vl import Qwen2VLProcessor

    with mock.patch.object(Qwen2VLProcessor, "check_argument_for_proper_class", lambda *args: None):
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)


def _default_tokenizer(directory: Path):
    """The default model's tokenizer (copied through `directory`, no download)."""
    from transformers import AutoTokenizer

    from common.model_files import resolve_model_dir

    tokenizer_dir = resolve_model_dir("smollm2-135m-instruct")
    staging = directory / "_tokenizer"
    staging.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tokenizer_dir}/{name}", staging / name)
    tokenizer = AutoTokenizer.from_pretrained(staging, local_files_only=True)
    shutil.rmtree(staging)
    return tokenizer


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
