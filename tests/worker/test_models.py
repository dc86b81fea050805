"""Our paged models against transformers' logits, plus weight loading and KV cache sizing.

Each tiny random model is saved by transformers, loaded by our loader, and run
the way the engine runs it: two sequences sharing steps (prefill chunks into a
paged cache with shuffled block ids, then decodes batched ahead of the other
sequence's chunks). Every position's logits must equal transformers' logits for
the whole sequence in one forward.

Sliding windows: transformers 5 applies `sliding_window` through
masking_utils.create_sliding_window_causal_mask for both the "sdpa" and the
"eager" attention implementations (key kept when q - sliding_window < k <= q);
the reference models use "sdpa" (Gemma: "eager", which soft-caps attention logits), and
`test_mistral_window_matters` checks the window really changes transformers' output;
`test_gemma_softcaps_matter` does the same for Gemma's two soft-caps.
"""
from __future__ import annotations

import pytest
import torch

from common.config import GiB, EngineConfig
from common.errors import ConfigError
from worker.attention.torch_backend import TorchAttentionBackend
from worker.kv_cache import allocate_kv_caches, kv_cache_spec, num_blocks_for
from worker.lm_head.final_softcap import with_final_softcap
from worker.lm_head.plain_logits import PlainLogitsLmHead
from worker.model_loader import load_model
from worker.models import get_model_class
from tiny_models import MOE_SIZES, routing_margins

BLOCK_SIZE = 4
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def longrope(rotary_dim: int = 16, **extra) -> dict:
    """Phi-3 style LongRoPE parameters with distinct short and long factors per frequency."""
    return {"rope_type": "longrope", "rope_theta": 10000.0, **extra,
            "short_factor": [1.0 + 0.2 * i for i in range(rotary_dim // 2)],
            "long_factor": [2.0 + 3.0 * i for i in range(rotary_dim // 2)]}


# Gemma: both layer kinds (layer_types), a window of 6, soft-caps that change the output
# (test_gemma_softcaps_matter), a query_pre_attn_scalar other than head_dim (16).
GEMMA_COMMON = {"sliding_window": 6, "query_pre_attn_scalar": 24, "final_logit_softcapping": 3.0}
GEMMA_VARIANTS = {
    "gemma2_softcaps_tied": ("Gemma2ForCausalLM", {**GEMMA_COMMON, "attn_logit_softcapping": 5.0,
                                                   "layer_types": ["sliding_attention", "full_attention",
                                                                   "sliding_attention"], "num_hidden_layers": 3}),
    "gemma2_no_caps_untied": ("Gemma2ForCausalLM", {**GEMMA_COMMON, "attn_logit_softcapping": None,
                                                    "final_logit_softcapping": None, "tie_word_embeddings": False}),
    "gemma3_local_rope": ("Gemma3ForCausalLM", {
        **GEMMA_COMMON, "num_hidden_layers": 3,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}}),
}

# Two sequences: (prompt chunk sizes, number of decode steps, first step it runs in).
SCHEDULE = (([7, 9, 8], 6, 0), ([5, 8], 8, 1))

VARIANTS = {
    "llama": ("LlamaForCausalLM", {}),
    "llama3_rope_tied": ("LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "llama_linear_rope_biases": ("LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
        "attention_bias": True, "mlp_bias": True}),
    "mistral_window_8": ("MistralForCausalLM", {"sliding_window": 8}),
    "qwen2_tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen2_window_upper_layer": ("Qwen2ForCausalLM", {
        "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen3_window_tied": ("Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 6,
                                               "max_window_layers": 1, "tie_word_embeddings": True}),
    "phi3": ("Phi3ForCausalLM", {}),
    "phi3_partial_rotary_tied": ("Phi3ForCausalLM", {"rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}, "tie_word_embeddings": True}),
    # LongRoPE with max_model_len (max_position_embeddings) at the original length, 64: the short
    # factors, as transformers takes them for these shorter sequences, and an attention factor of
    # sqrt(1 + ln 4 / ln 64); the window applies to every layer.
    "phi3_longrope_short_window_8": ("Phi3ForCausalLM", {
        "rope_parameters": longrope(factor=4.0), "sliding_window": 8, "max_position_embeddings": 64,
        "original_max_position_embeddings": 64}),
    # Phi-4-mini's shape: 3/4 of each head rotates (12 of 16 features). Sequences (21, 30 tokens) longer
    # than original_max_position_embeddings (16): the long factors at every position, in both.
    "phi3_partial_rotary_longrope_long": ("Phi3ForCausalLM", {
        "rope_parameters": longrope(12, partial_rotary_factor=0.75), "original_max_position_embeddings": 16}),
    # Mixtures of experts (4 experts, top-2): Mixtral's float32 routing weights, Qwen2-MoE's
    # shared expert with a dense layer 1 (`mlp_only_layers`), Qwen3-MoE's renormalised
    # weights with only layer 1 of 3 sparse (`decoder_sparse_step`).
    "mixtral_window_8": ("MixtralForCausalLM", {**MOE_SIZES["MixtralForCausalLM"], "sliding_window": 8}),
    "qwen2_moe_shared_dense_layer": ("Qwen2MoeForCausalLM", {**MOE_SIZES["Qwen2MoeForCausalLM"],
                                                             "mlp_only_layers": [1]}),
    "qwen3_moe_sparse_step_norm": ("Qwen3MoeForCausalLM", {**MOE_SIZES["Qwen3MoeForCausalLM"],
                                                           "decoder_sparse_step": 2, "num_hidden_layers": 3,
                                                           "norm_topk_prob": True}),
    **GEMMA_VARIANTS,
}
# Least gap between a token's k-th and (k+1)-th router probability: float32 router
# probabilities of ours and transformers agree to ~1e-7, so no expert choice can differ.
MOE_MARGIN = 1e-5


def load_ours(model_dir, dtype=torch.float32):
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", seed=0)
    model, hf_config, loaded_dir = load_model(config, "cpu", dtype)
    assert loaded_dir == str(model_dir)
    return model, hf_config


def run_paged(model, hf_config, sequences: list[torch.Tensor], make_metadata, make_block_tables,
              schedule=SCHEDULE, dtype=torch.float32, backend=None) -> list[torch.Tensor]:
    """Feed each sequence's known tokens through the schedule; its logits [len, vocab] per sequence."""
    g = torch.Generator().manual_seed(1)
    num_blocks = sum(len(s) for s in sequences) // BLOCK_SIZE + 8
    tables = make_block_tables([len(s) for s in sequences], BLOCK_SIZE, num_blocks, g)
    caches = allocate_kv_caches(hf_config, num_blocks, BLOCK_SIZE, dtype, "cpu")
    pieces = [list(chunks) + [1] * decodes for chunks, decodes, _ in schedule]
    for seq, tokens in enumerate(sequences):
        assert sum(pieces[seq]) == len(tokens)
    done = [0] * len(sequences)
    logits: list[list[torch.Tensor]] = [[] for _ in sequences]
    backend = backend or TorchAttentionBackend()
    step = 0
    while any(pieces):
        active = [s for s, (_, _, start) in enumerate(schedule) if pieces[s] and start <= step]
        active.sort(key=lambda s: pieces[s][0] != 1)  # one-token pieces (decodes) first
        lengths = [pieces[s].pop(0) for s in active]
        meta = make_metadata([done[s] for s in active], lengths, [tables[s] for s in active],
                             BLOCK_SIZE, num_decodes=sum(1 for n in lengths if n == 1))
        ids = torch.cat([sequences[s][done[s]:done[s] + n] for s, n in zip(active, lengths)])
        positions = torch.cat([torch.arange(done[s], done[s] + n) for s, n in zip(active, lengths)])
        out = lm_head_of(model).logits(model(ids, positions, caches, meta, backend))
        assert out.dtype == torch.float32
        for s, piece in zip(active, out.split(lengths)):
            logits[s].append(piece)
            done[s] += len(piece)
        step += 1
    return [torch.cat(parts) for parts in logits]


def lm_head_of(model):
    """The plain lm_head, with the model's final logit soft-capping if it has one (Gemma)."""
    return with_final_softcap(PlainLogitsLmHead(model.lm_head), getattr(model, "final_logit_softcapping", None))


def random_sequences(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab, (sum(chunks) + decodes,), generator=g) for chunks, decodes, _ in SCHEDULE]


def assert_logits_match(ours: torch.Tensor, reference: torch.Tensor) -> None:
    scale = reference.abs().max().item()
    assert scale > 1.0  # the random model produces a real spread of logits
    torch.testing.assert_close(ours, reference, atol=1e-4 * scale, rtol=0)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant, tiny_hf_model, make_metadata, make_block_tables) -> None:
    architecture, overrides = VARIANTS[variant]
    hf_model, model_dir = tiny_hf_model(architecture, **overrides)
    model, hf_config = load_ours(model_dir)
    assert type(model).__name__ == architecture
    sequences = random_sequences(hf_config.vocab_size)
    ours = run_paged(model, hf_config, sequences, make_metadata, make_block_tables)
    with torch.no_grad():
        for tokens, logits in zip(sequences, ours):
            if architecture in MOE_SIZES:
                assert routing_margins(hf_model, tokens[None]).min() > MOE_MARGIN
            assert_logits_match(logits, hf_model(tokens[None]).logits[0])


def test_mistral_window_matters(tiny_hf_model) -> None:
    """The Mistral variant would pass without a window if transformers ignored it."""
    hf_model, _ = tiny_hf_model("MistralForCausalLM", sliding_window=8)
    tokens = random_sequences(hf_model.config.vocab_size)[0]
    with torch.no_grad():
        windowed = hf_model(tokens[None]).logits[0]
        hf_model.config.sliding_window = None
        full = hf_model(tokens[None]).logits[0]
    torch.testing.assert_close(windowed[:8], full[:8])
    assert (windowed[8:] - full[8:]).abs().amax(-1).min() > 1e-3


def test_qwen2_sliding_window_rules(tiny_hf_model) -> None:
    _, model_dir = tiny_hf_model("Qwen2ForCausalLM", sliding_window=6, num_hidden_layers=3,
                                 use_sliding_window=True, max_window_layers=1)
    assert load_ours(model_dir)[0].sliding_windows == [None, 6, 6]
    _, model_dir = tiny_hf_model("Qwen2ForCausalLM", sliding_window=6, max_window_layers=0)
    assert load_ours(model_dir)[0].sliding_windows == [None, None]  # use_sliding_window defaults to False


def test_dynamic_rope_matches_incremental_decoding(tiny_hf_model, make_metadata, make_block_tables) -> None:
    """Past max_position_embeddings dynamic NTK depends on the sequence length at each
    step, so the reference is transformers decoding token by token with its cache."""
    from transformers import DynamicCache

    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    hf_model, model_dir = tiny_hf_model("LlamaForCausalLM", rope_parameters=rope, max_position_embeddings=16)
    model, hf_config = load_ours(model_dir)
    schedule = (([6, 8], 14, 0),)  # prompt of 14 tokens, decoding on to position 27
    tokens = torch.randint(0, hf_config.vocab_size, (28,), generator=torch.Generator().manual_seed(3))
    (ours,) = run_paged(model, hf_config, [tokens], make_metadata, make_block_tables, schedule)
    with torch.no_grad():
        out = hf_model(tokens[None, :14], past_key_values=DynamicCache(config=hf_config), use_cache=True)
        reference = [out.logits[0]]
        for pos in range(14, 28):
            out = hf_model(tokens[None, pos:pos + 1], past_key_values=out.past_key_values, use_cache=True)
            reference.append(out.logits[0])
    assert_logits_match(ours, torch.cat(reference))


def bf16_runs(model_dir, make_metadata, make_block_tables):
    """Our bfloat16 model on `random_sequences`: (sequences, one whole-prompt pass through the
    PyTorch attention path, the chunked/paged schedule through the default kernels)."""
    model, hf_config = load_ours(model_dir, dtype=torch.bfloat16)
    assert model.embed_tokens.dtype == torch.bfloat16
    sequences = random_sequences(hf_config.vocab_size)
    whole_prompt = tuple(([len(tokens)], 0, 0) for tokens in sequences)
    # SDPA attention (the PyTorch path), as transformers uses: the C++ kernel rounds
    # differently (float32 throughout), which an op-for-op check would not tell apart
    # from a model bug; it is held to the chunked tolerance.
    single_pass = run_paged(model, hf_config, sequences, make_metadata, make_block_tables,
                            whole_prompt, dtype=torch.bfloat16, backend=TorchAttentionBackend(use_cpu_kernel=False))
    chunked = run_paged(model, hf_config, sequences, make_metadata, make_block_tables, dtype=torch.bfloat16)
    return sequences, single_pass, chunked


@pytest.mark.parametrize("architecture,overrides", [
    ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    ("Phi3ForCausalLM", VARIANTS["phi3_partial_rotary_longrope_long"][1]),
])
def test_bfloat16_matches_transformers_bfloat16(architecture, overrides, tiny_hf_model, make_metadata,
                                                make_block_tables) -> None:
    """One whole-prompt prefill follows transformers' bf16 rounding op for op (a swapped
    cast in RMSNorm alone moves logits by ~3% of their scale); chunked/paged runs take
    other kernels, so there only closeness is required."""
    from transformers import AutoModelForCausalLM

    _, model_dir = tiny_hf_model(architecture, **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    sequences, single_pass, chunked = bf16_runs(model_dir, make_metadata, make_block_tables)
    with torch.no_grad():
        for tokens, ours_single, ours_chunked in zip(sequences, single_pass, chunked):
            reference = hf_model(tokens[None]).logits[0].float()
            scale = reference.abs().max()
            assert (ours_single - reference).abs().max() <= 2e-3 * scale
            assert (ours_chunked - reference).abs().max() <= 5e-2 * scale


# Seeds whose bfloat16 routing has no near tie on `random_sequences` (most seeds have
# a gap of one bfloat16 step of a router logit, ~1e-3 in probability, somewhere).
MOE_BF16_SEEDS = {"MixtralForCausalLM": 0, "Qwen2MoeForCausalLM": 4, "Qwen3MoeForCausalLM": 4}


@pytest.mark.parametrize("architecture", list(MOE_BF16_SEEDS))
def test_moe_bfloat16_matches_transformers_bfloat16(architecture, tmp_path, make_metadata,
                                                    make_block_tables) -> None:
    """As test_bfloat16_matches_transformers_bfloat16 for the mixtures of experts: the routing
    weights' dtype and the order of the experts' bf16 sums follow transformers' eager experts."""
    from transformers import AutoModelForCausalLM

    from tiny_models import build_tiny_hf_model

    build_tiny_hf_model(architecture, tmp_path, seed=MOE_BF16_SEEDS[architecture], **MOE_SIZES[architecture])
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                    experts_implementation="eager")
    sequences, single_pass, chunked = bf16_runs(tmp_path, make_metadata, make_block_tables)
    with torch.no_grad():
        for tokens, ours_single, ours_chunked in zip(sequences, single_pass, chunked):
            assert routing_margins(hf_model, tokens[None]).min() > 1e-3
            reference = hf_model(tokens[None]).logits[0].float()
            scale = reference.abs().max()
            assert (ours_single - reference).abs().max() <= 2e-3 * scale
            # Chunked steps take other kernels: a one-step difference of a bf16 router logit
            # can flip a close routing choice (moving that token's output by a fraction of an
            # expert's); most positions must still be as close as the dense models' are.
            close = (ours_chunked - reference).abs().amax(-1) <= 5e-2 * scale
            assert close.float().mean() >= 0.9


@pytest.mark.parametrize("variant", ["gemma2_softcaps_tied", "gemma3_local_rope"])
def test_gemma_bfloat16_matches_transformers_bfloat16(variant, tiny_hf_model, make_metadata,
                                                      make_block_tables) -> None:
    """As the Llama check above: Gemma's (1 + w) norms, scaled embeddings and both soft-caps
    rounded as transformers rounds them in bfloat16. The reference attention is the one our
    PyTorch path rounds like: SDPA, or with soft-capped scores (which SDPA cannot cap) eager.
    These tiny random models amplify rounding: transformers' own eager and SDPA bf16 logits
    differ by ~10% of their scale, so only a model rounding op for op passes."""
    from transformers import AutoModelForCausalLM

    architecture, overrides = GEMMA_VARIANTS[variant]
    _, model_dir = tiny_hf_model(architecture, **overrides)
    attention = "eager" if architecture == "Gemma2ForCausalLM" and overrides.get("attn_logit_softcapping") else "sdpa"
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation=attention)
    sequences, single_pass, chunked = bf16_runs(model_dir, make_metadata, make_block_tables)
    with torch.no_grad():
        for tokens, ours_single, ours_chunked in zip(sequences, single_pass, chunked):
            reference = hf_model(tokens[None]).logits[0].float()
            scale = reference.abs().max()
            assert (ours_single - reference).abs().max() <= 2e-3 * scale
            assert (ours_chunked - reference).abs().max() <= 0.15 * scale


def test_unknown_architecture_is_rejected() -> None:
    from transformers import GPT2Config

    config = GPT2Config()
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        get_model_class(config)


def test_load_weights_rejects_missing_and_unexpected_names(tiny_hf_model) -> None:
    hf_model, model_dir = tiny_hf_model("LlamaForCausalLM")
    model = get_model_class(hf_model.config)(hf_model.config)
    weights = dict(hf_model.state_dict())
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        model.load_weights(weights.items())
    weights = dict(hf_model.state_dict(), **{"model.layers.0.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.0.extra.weight'\]"):
        model.load_weights(weights.items())
    weights = dict(hf_model.state_dict(), **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)})
    model.load_weights(weights.items())  # old checkpoints' rotary buffers are ignored


def test_sharded_checkpoint_loads_every_tensor(tiny_hf_model, tmp_path) -> None:
    hf_model, _ = tiny_hf_model("Qwen2ForCausalLM")
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    model, _ = load_ours(sharded)
    reference = hf_model.state_dict()
    targets = model.weight_targets()
    assert set(targets) == set(reference)
    for name, (target, part) in targets.items():
        assert part is None  # one worker: whole tensors
        assert torch.equal(target, reference[name]), name


def test_kv_cache_sizing(tiny_hf_model) -> None:
    hf_model, _ = tiny_hf_model("LlamaForCausalLM")  # 2 layers, 2 KV heads, head_dim 16
    spec = kv_cache_spec(hf_model.config, block_size=16, dtype=torch.bfloat16)
    assert spec.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 2
    config = EngineConfig(device="cpu", kv_cache_memory=10 * spec.bytes_per_block + 5)
    assert num_blocks_for(config, spec, "cpu") == 10
    assert num_blocks_for(config.replace(num_gpu_blocks_override=3), spec, "cpu") == 3
    with pytest.raises(ConfigError, match="KV cache blocks"):
        num_blocks_for(config.replace(kv_cache_memory=spec.bytes_per_block), spec, "cpu")
    assert num_blocks_for(EngineConfig(device="cpu", kv_cache_memory=GiB), spec, "cpu") == GiB // 4096

    caches = allocate_kv_caches(hf_model.config, 7, 16, torch.bfloat16, "cpu")
    assert len(caches) == 2
    for k_cache, v_cache in caches:
        assert k_cache.shape == v_cache.shape == (7, 16, 2, 16)
        assert k_cache.dtype == torch.bfloat16 and not k_cache.any() and not v_cache.any()
        assert k_cache.data_ptr() != v_cache.data_ptr()
