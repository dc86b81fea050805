"""The model's forward pass for the runner: compiled with torch.compile (inductor)
unless the engine runs eager, with a fallback to eager when compilation fails.

What is compiled is a group of consecutive decoder layers
(`worker.models.llama.decoder_layers`): norms, projections, rotary, MLP and
residuals fused around the attention, which is an opaque custom op taking the
step's metadata from the step context (see worker.attention.step_context).
The layers' weights and indices are graph inputs, so one graph serves every
group. A group is the largest divisor of the layer count up to
`MAX_LAYERS_PER_GRAPH` (a remainder group would be a second graph): each call
of a compiled graph pays a fixed Python cost in dynamo's and inductor's
wrappers, so a few layers a call beat one (bit for bit the same output),
while all layers in one graph would make every start compile for much
longer (docs/performance-notes.md). The token dimension is dynamic,
so the same graph serves every batch size of two tokens or more; the compiler
specializes size-1 dimensions, so one-token steps (one sequence decoding) have
a second graph of their own rather than a padding row, which every matmul
would multiply (a sixth of a single-stream decode step). Both graphs are built
at start-up (`warm_up`) and their compile time reported, so nothing compiles
while serving; on CPU it needs a C++
compiler (inductor generates C++), on CUDA triton and a C compiler, and any
failure falls back to eager with a warning. On CUDA, decode steps then replay
CUDA graphs of this forward (worker.cuda_graphs).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from worker.attention.kv_rotation import kv_rotations
from worker.attention.metadata import AttentionMetadata
from worker.attention.step_context import step_context

logger = logging.getLogger(__name__)

MAX_LAYERS_PER_GRAPH = 6
# Each engine built in one process (offline `LLM` objects one after another: other models,
# dtypes, quantizations) adds its own graph of `decoder_layers`; dynamo's default limit of 8
# per function would turn the ninth engine eager.
RECOMPILE_LIMIT = 64


def layers_per_graph(num_layers: int, limit: int = MAX_LAYERS_PER_GRAPH) -> int:
    """The largest divisor of num_layers that is at most `limit`: every group the same size."""
    return max(size for size in range(1, min(limit, num_layers) + 1) if num_layers % size == 0)


def inductor_available(device: torch.device | None = None) -> bool:
    """Inductor on CPU compiles the C++ it generates: a compiler must be on PATH. On CUDA it
    generates triton kernels, whose launchers triton builds with a C compiler."""
    import importlib.util
    import shutil
    if device is not None and device.type == "cuda":
        return importlib.util.find_spec("triton") is not None and any(
            shutil.which(name) for name in (os.environ.get("CC", ""), "gcc", "cc", "clang") if name)
    return any(shutil.which(name) for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if name)


def compile_options(dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Inductor options under which the compiled step computes the eager function.

    emulate_precision_casts rounds fused bf16/fp16 intermediates as eager does (bf16
    logits within ~1e-3 of eager, not ~1e-2). On CPU, inductor's pattern matcher also
    folds a residual add into the matmul before it (`h + x @ W.T` -> addmm), which in a
    16-bit dtype adds h before the product is rounded: eager rounds twice, so a quarter
    of such sums moved by one bf16 step. It stays on for float32 (the same value up to
    summation order) and on GPUs, where inductor itself keeps such adds apart. Where the
    CPU has AVX512-BF16 the packed matmuls are opaque custom ops and nothing fuses anyway.
    """
    options: dict[str, Any] = {"emulate_precision_casts": True}
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        options["pattern_matcher"] = False
    return options


class ModelForward:
    """Callable (input_ids [T], positions [T], meta) -> final hidden states [T, hidden]."""

    def __init__(self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: Any, *,
                 max_model_len: int, compile: bool, kv_scales: list[tuple[float, float]] | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales  # an 8-bit cache's per-layer (k_scale, v_scale)
        self.kv_rotation = kv_rotations(kv_caches, kv_scales)  # 8-bit caches: q, k rotated
        self.backend = backend
        self.dtype: torch.dtype = model.dtype
        self.device: torch.device = model.device
        # The whole rotary table up front: a table that grows would change a graph constant.
        if max_model_len:  # (LongRoPE picks its factors by it)
            model.rotary.set_max_model_len(max_model_len)
        model.rotary.reserve(max_model_len + 1, self.dtype, self.device)
        self.compile_seconds = 0.0
        self.group_size = 1  # layers a call; compiled, layers_per_graph
        self._compiled = None
        if compile and not inductor_available(self.device):
            logger.warning("torch.compile needs a C++ compiler (g++) on CPU, triton and a C compiler on CUDA; "
                           "running the model eager")
            compile = False
        if compile:
            from worker.models.llama import decoder_layers
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            # A model with its own layer function (Gemma) names it `layers_function`.
            layers_function = getattr(type(model), "layers_function", None) or decoder_layers
            self._compiled = torch.compile(layers_function, dynamic=True, fullgraph=True,
                                           options=compile_options(self.dtype, self.device))
            self.group_size = layers_per_graph(len(model.layers))

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds`: the step's input embeddings when not the token lookup (images)."""
        self.model.rotary.reserve(meta.max_seq_len, self.dtype, self.device)  # a no-op once reserved
        embeds = {} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        with step_context(self.backend, meta, self.kv_caches, self.kv_scales, self.kv_rotation):
            if self._compiled is None:
                return self.model.forward_tokens(input_ids, positions, **embeds)
            try:
                return self.model.forward_tokens(input_ids, positions, self._compiled, self.group_size, **embeds)
            except Exception as exc:  # a compiler/toolchain failure must not take serving down
                # The same step eager: if it fails too, the step is at fault, not the compiled
                # graph, which stays (the error goes up as it would have without compiling).
                hidden = self.model.forward_tokens(input_ids, positions, **embeds)
                logger.warning("compiled model step failed (%s: %s); running eager from now on",
                               type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
                self._compiled = None
                return hidden

    def warm_up(self, block_size: int, num_tokens: int = 256) -> None:
        """Compile now (not on the first request), records `compile_seconds`.

        The warm-up batch is large on purpose: inductor tunes the generated
        loops (which ones run in parallel, how they are tiled) for the sizes it
        sees first, and real steps are large. It is `num_tokens` one-token
        sequences that all live in the null block, which is zeroed again after;
        then one such sequence alone, for the one-token graph."""
        if self._compiled is None:
            return
        started = time.perf_counter()
        with torch.inference_mode():
            for tokens in (num_tokens, 1):
                self._null_block_step(tokens)
        self.compile_seconds = time.perf_counter() - started
        if self._compiled is not None:
            logger.info("Compiled the model step in %.1f s", self.compile_seconds)

    def _null_block_step(self, num_tokens: int) -> None:
        """A step of `num_tokens` one-token sequences in the null block, zeroed again after."""
        ones = torch.ones(num_tokens, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            num_decodes=num_tokens,
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=self.device),
            query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=self.device),
            seq_lens=ones, block_tables=torch.zeros((num_tokens, 1), dtype=torch.int32, device=self.device),
            max_query_len=1, max_seq_len=1, query_start_loc_cpu=list(range(num_tokens + 1)),
            seq_lens_cpu=[1] * num_tokens)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        self(input_ids, positions, meta)
        for k_cache, v_cache in self.kv_caches:
            k_cache[0].zero_()  # block 0 is the null block: padding must read zeros
            v_cache[0].zero_()
