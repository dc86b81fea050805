"""Engine configuration: every knob the scheduler and worker share, checked up front."""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

from common.errors import ConfigError
from common.pooling_params import RUNNERS, PoolerConfig
from common.speculative_config import SpeculativeConfig

GiB = 1 << 30
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The KV cache's element type: "auto" is the model's; "bfloat16" halves a float32 model's cache
# (twice the tokens in the same memory, half the bytes each decode step reads); the 8-bit floats
# ("fp8" = "fp8_e4m3", or "fp8_e5m2", as vLLM) halve a 16-bit cache again, with per-layer scales.
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = ("auto", "bfloat16", *FP8_KV_CACHE_DTYPES)
DEVICES = ("auto", "cpu", "cuda")
# How the linear layers' weights are kept and multiplied (vLLM's --quantization): "int8" is W8A8
# (int8 weights with per-channel scales made at load, int8 activations with per-token scales);
# "gguf" keeps a .gguf model's quantized blocks and multiplies in their format; "none" runs the
# weights at --dtype (a .gguf model dequantized at load). Unset: "gguf" for a .gguf model, else "none".
QUANTIZATIONS = ("none", "int8", "gguf")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


def cpu_flags_line() -> str:
    """This CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo's names; empty where there is none)."""
    return set(cpu_flags_line().split())


def cpu_supports_bf16() -> bool:
    """True on CPUs with native bf16 matmuls (AVX-512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def window_fits(sliding_window: int, num_blocks: int, block_size: int, max_step_tokens: int) -> bool:
    """Whether a sequence of any length fits the KV cache alone when every layer sees only the
    latest `sliding_window` positions: it holds the window and one step's new slots at most."""
    if sliding_window <= 0:
        return False
    peak_tokens = sliding_window - 1 + max_step_tokens
    return -(-peak_tokens // block_size) + 1 <= num_blocks - 1  # +1: a window straddles blocks


@dataclass(slots=True)
class EngineConfig:
    """Settings for one model replica. Model-dependent defaults (max_model_len)
    are resolved by `resolve_max_model_len` once the model's shape is known."""

    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None  # defaults to the model's own; a directory or a Hub id
    tokenizer_revision: str | None = None  # of a Hub id `tokenizer`
    # A Hub model's branch, tag or commit (common.hub_models; `model` may carry it as ORG/NAME@REV
    # too), and the one .gguf of a Hub repository (or local directory) to serve.
    revision: str | None = None
    gguf_file: str | None = None
    # Accepted for vLLM's command lines; no code from a model repository is ever run: an
    # architecture without an implementation here is refused with the supported list.
    trust_remote_code: bool = False
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None  # one of QUANTIZATIONS; None: chosen by the model's format
    device: str = "auto"
    attention_backend: str = "auto"
    block_size: int | None = None  # CPU: 128 tokens of 16-bit K/V (32 with AMX), same bytes in every dtype; CUDA: 16
    kv_cache_memory: int = 4 * GiB  # bytes, CPU (like VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.9  # CUDA
    num_gpu_blocks_override: int | None = None  # fixes the block count (tests, ops)
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # 4096 on CPU, 2048 on CUDA
    enable_prefix_caching: bool = True
    seed: int = 0
    enforce_eager: bool = False  # compile the model step unless set (where supported); CUDA: no graphs either
    # CUDA: decode steps of up to this many sequences replay captured CUDA graphs (vLLM's
    # max_capture_size), at most max_num_seqs; None: 256 (or max_num_seqs). 0: no graphs.
    max_cudagraph_batch_size: int | None = None
    model_cache_dir: str | None = None  # where converted GGUF models are kept
    max_logprobs: int = 20  # the most (prompt) logprobs a request may ask for per token; -1: the vocabulary
    # bf16/fp16 models: settle greedy near ties (top logits within two rounding steps) by float32
    # dot products, as float32 would pick; off: the argmax of the model-dtype logits, as vLLM.
    greedy_rescore_near_ties: bool = False
    # Parallelism (vLLM's names): worker ranks splitting one replica's model (tensor: heads and
    # MLP columns; pipeline: layers), and replicas, each a scheduler with its own worker group.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_init_method: str | None = None  # tcp://HOST:PORT; None: MASTER_ADDR/MASTER_PORT
    # Draft tokens checked by the model in one pass (common.speculative_config); a dict or the
    # CLI's JSON text is parsed on construction.
    speculative_config: SpeculativeConfig | None = None
    # vLLM's --runner: "pooling" serves embeddings (common.pooling_params), "generate" text; "auto"
    # is pooling for encoder-only models (BertModel). `pooler_config` overrides the model's pooling.
    runner: str = "auto"
    pooler_config: PoolerConfig | None = None
    # Vision-language models: the most items of a modality per prompt ({"image": N}; vLLM's
    # --limit-mm-per-prompt); a modality not named allows 1.
    limit_mm_per_prompt: dict[str, int] | None = None
    # Multi-LoRA (vLLM's flags): adapters on q/k/v/o and gate/up/down. max_loras: distinct adapters
    # one step may run (device slots); max_cpu_loras: adapters kept loaded in the worker (LRU),
    # None: max_loras; max_lora_rank: the largest rank an adapter may have.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        if self.block_size is None:
            self.block_size = self.default_block_size()
        self.validate()

    def validate(self) -> None:
        if self.gguf_file is not None and not self.gguf_file.lower().endswith(".gguf"):
            raise ConfigError(f"gguf_file must name a .gguf file, got {self.gguf_file!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "bfloat16" and self.dtype == "float16":
            raise ConfigError("kv_cache_dtype bfloat16 needs a float32 or bfloat16 model, not float16")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError(f"num_gpu_blocks_override must be >= 2, got {self.num_gpu_blocks_override}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.max_logprobs < -1:
            raise ConfigError(f"max_logprobs must be -1 (no bound) or at least 0, got {self.max_logprobs}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_cudagraph_batch_size is not None and self.max_cudagraph_batch_size < 0:
            raise ConfigError("max_cudagraph_batch_size must be 0 (no CUDA graphs) or positive, "
                              f"got {self.max_cudagraph_batch_size}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.distributed_init_method is not None and not self.distributed_init_method.startswith(
                ("tcp://", "env://", "file://")):
            raise ConfigError("distributed_init_method must be tcp://HOST:PORT, env:// or file://PATH, "
                              f"got {self.distributed_init_method!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.runner not in RUNNERS:
            raise ConfigError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.runner == "pooling" and self.speculative_config is not None:
            raise ConfigError("speculative decoding generates tokens; it does not combine with runner 'pooling'")
        for modality, limit in (self.limit_mm_per_prompt or {}).items():
            if modality != "image" or not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ConfigError(f"limit_mm_per_prompt takes {{\"image\": N}} with N >= 0, got {modality!r}: {limit!r}")
        if self.speculative_config is not None and self.world_size > 1:
            raise ConfigError("speculative decoding runs on one worker rank; it does not combine with "
                              "tensor_parallel_size or pipeline_parallel_size above 1")

        self.validate_lora()

    def validate_lora(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if not self.enable_lora:
            return
        if self.world_size > 1:
            raise ConfigError("enable_lora runs on one worker rank; it does not combine with "
                              "tensor_parallel_size or pipeline_parallel_size above 1")
        if self.speculative_config is not None:
            raise ConfigError("enable_lora does not combine with speculative decoding")
        if self.quantization not in (None, "none"):
            raise ConfigError(f"enable_lora needs unquantized linear weights, not quantization {self.quantization!r}")
        if self.runner == "pooling":
            raise ConfigError("enable_lora generates tokens; it does not combine with runner 'pooling'")

    def resolved_max_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    # --- resolved values -------------------------------------------------
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        torch = sys.modules.get("torch")  # never import torch here: the scheduler stays device-free
        if torch is not None:
            return "cuda" if torch.cuda.is_available() else "cpu"
        return "cuda" if os.path.exists("/proc/driver/nvidia/version") else "cpu"

    def default_block_size(self) -> int:
        # CPU: the same bytes per block in every dtype (float32 half the tokens, 8-bit caches
        # twice). Without AMX, 128 tokens of a 16-bit cache: the decode kernel streams each
        # sequence's K/V block by block and 48 KiB runs read ~25 % faster than 16-token ones
        # (measured on an AMD EPYC). With AMX, 32: there 16, 32 and 128 decode at the same speed,
        # the AMX attention tiles take 16 keys at a time, and prefix caching (whole blocks only)
        # recomputes less of a shared prompt: P1 ~20 % faster than with 128
        # (docs/performance-notes.md).
        if self.resolved_device() == "cuda":
            return 16
        tokens = 32 if "amx_bf16" in cpu_flags() else 128
        kv_cache_dtype = self.resolved_kv_cache_dtype()
        return tokens // 2 if kv_cache_dtype == "float32" else tokens * 2 if kv_cache_dtype in FP8_KV_CACHE_DTYPES \
            else tokens

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        if self.resolved_device() == "cuda":
            return "bfloat16"
        return "bfloat16" if cpu_supports_bf16() else "float32"

    def resolved_kv_cache_dtype(self) -> str:
        return self.resolved_dtype() if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.resolved_device() == "cuda" else "torch"

    def resolved_max_cudagraph_batch_size(self) -> int:
        """The largest decode batch replayed from a CUDA graph; 0: none (--enforce-eager too, and
        LoRA: its delta op groups tokens by adapter on the host every step)."""
        if self.enforce_eager or self.enable_lora:
            return 0
        wanted = 256 if self.max_cudagraph_batch_size is None else self.max_cudagraph_batch_size
        return min(wanted, self.max_num_seqs)  # a decode step never holds more sequences

    def resolved_max_num_batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.resolved_device() == "cuda" else 4096

    def max_step_tokens(self) -> int:
        """The most KV slots one step adds to a request: its chunk plus a draft model's lookahead."""
        spec = self.speculative_config
        return self.resolved_max_num_batched_tokens() + (spec.lookahead_slots if spec is not None else 0)

    def resolve_max_model_len(self, model_limit: int, num_blocks: int, sliding_window: int = 0) -> int:
        """The longest sequence we serve: the user's value, else the model's
        limit capped by what the KV cache holds. A user value above either
        limit is an error, never a silent truncation. `sliding_window`: that of
        every layer (0: none), whose sequences hold only their window's blocks."""
        # Block 0 is reserved; a sequence of L tokens keeps the KV of its first L-1.
        cache_tokens = (num_blocks - 1) * self.block_size + 1
        if window_fits(sliding_window, num_blocks, self.block_size, self.max_step_tokens()):
            cache_tokens = model_limit
        if self.max_model_len is None:
            return max(1, min(model_limit, cache_tokens))
        if self.max_model_len > model_limit:
            raise ConfigError(f"max_model_len={self.max_model_len} exceeds the model's limit of {model_limit} tokens")
        if self.max_model_len > cache_tokens:
            raise ConfigError(
                f"max_model_len={self.max_model_len} needs more KV cache than available "
                f"({num_blocks - 1} usable blocks of {self.block_size} tokens); "
                f"raise kv_cache_memory or lower max_model_len")
        return self.max_model_len

    @property
    def world_size(self) -> int:
        """Worker ranks in one replica's group: tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
