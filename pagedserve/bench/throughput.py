"""Offline throughput of pagedserve: the one-process engine (`pagedserve.offline.llm.LLM`) on a workload.

Every request runs with ignore_eos, so it yields exactly its max_tokens; greedy unless
a `SamplingChoice` says otherwise.
A short untimed warm-up runs first (the model step is compiled at start-up,
so this only touches the caches); the timed run covers everything from the
first request added to the last output, like `vllm_offline_runner.py`.
"""
from __future__ import annotations

import gc
import resource
import time
from dataclasses import asdict, dataclass
from typing import Any

from pagedserve.bench.workloads import BenchRequest, workload_summary
from common.config import GiB, EngineConfig
from common.sampling_params import SamplingParams


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class SamplingChoice:
    """How every request of the timed run samples (greedy by default)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def params(self, max_tokens: int) -> SamplingParams:
        params = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                                max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)
        params.validate()
        return params


def run_throughput(config: EngineConfig, requests: list[BenchRequest], *, detokenize: bool = True,
                   use_tqdm: bool = False, workload_name: str = "",
                   sampling: SamplingChoice = SamplingChoice(), loras: list | None = None) -> dict[str, Any]:
    """Run `requests` through a fresh engine; returns the result record (see `docs/benchmarks.md`).
    `loras`: each request's LoRARequest (or None); the same requests then run on the base model
    first, in the same engine, and the record compares the two (`lora_vs_base`)."""
    import torch

    from pagedserve.offline.llm import LLM

    started = time.perf_counter()
    llm = LLM.from_config(config, skip_tokenizer_init=not detokenize)
    init_s = time.perf_counter() - started
    warm_up = [{"prompt_token_ids": r.prompt_token_ids[:16]} for r in requests[:2]]
    llm.generate(warm_up, greedy_params(4), use_tqdm=False)
    llm.scheduler.reset_prefix_cache()  # the timed run must not reuse the warm-up's blocks
    # Objects alive now (model, tokenizer, imports) never become garbage: keep the
    # collector from walking them during the timed run.
    gc.collect()
    gc.freeze()

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [sampling.params(r.max_tokens) for r in requests]
    lora_fields: dict[str, Any] = {}
    if loras is not None:
        started = time.perf_counter()
        base_tokens = sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=use_tqdm))
        base_rate = base_tokens / (time.perf_counter() - started)
        adapters = {lora.lora_name: lora for lora in loras if lora is not None}
        llm.generate(warm_up[:1] * len(adapters), greedy_params(4), use_tqdm=False, lora_request=list(adapters.values()))
        llm.scheduler.reset_prefix_cache()
    spec_before = _spec_counts(llm)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=loras)
    elapsed = time.perf_counter() - started
    gc.unfreeze()
    if loras is not None:
        rate = sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed
        lora_fields = {"lora_adapters": len(adapters), "lora_requests": sum(lora is not None for lora in loras),
                       "base_output_tokens_per_s": round(base_rate, 2), "lora_vs_base": round(rate / base_rate, 3)}

    summary = workload_summary(requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    if output_tokens != summary["output_tokens"]:
        raise RuntimeError(f"expected {summary['output_tokens']} output tokens, got {output_tokens}")
    stats = llm.loop_stats
    steps = max(stats.steps, 1)
    block_bytes = _bytes_per_block(llm)
    return {
        "system": "pagedserve",
        "workload": workload_name,
        **summary,
        "elapsed_s": round(elapsed, 6),  # microseconds: a tiny run takes only milliseconds
        "output_tokens_per_s": round(output_tokens / elapsed, 2),
        "total_tokens_per_s": round((output_tokens + summary["prompt_tokens"]) / elapsed, 2),
        "requests_per_s": round(len(requests) / elapsed, 3),
        "sampling": asdict(sampling),
        "steps": stats.steps,
        "scheduler_ms_per_step": round(stats.scheduler_ms_per_step, 3),
        "execute_ms_per_step": round(stats.execute_ns / 1e6 / steps, 3),
        "outputs_ms_per_step": round(stats.outputs_ns / 1e6 / steps, 3),
        "scheduler_share": round((stats.schedule_ns + stats.update_ns) / (elapsed * 1e9), 4),
        "dtype": llm.worker.dtype_name,
        "kv_cache_dtype": llm.worker.kv_cache_dtype_name,
        "compiled": llm.worker.forward.compiled,
        "compile_s": round(llm.worker.forward.compile_seconds, 1),
        "init_s": round(init_s, 1),
        "threads": torch.get_num_threads(),
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": llm.scheduler.max_num_batched_tokens,
        "peak_kv_blocks": stats.peak_used_blocks,
        "peak_kv_gib": round(stats.peak_used_blocks * block_bytes / GiB, 6),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB, 3),
        **_spec_decode_fields(llm, spec_before),
        **lora_fields,
    }


def _spec_counts(llm: Any) -> tuple[int, int, int]:
    stats = llm.scheduler.spec_stats
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


def _spec_decode_fields(llm: Any, before: tuple[int, int, int]) -> dict[str, Any]:
    """With --speculative-config: the config, and the timed run's drafts."""
    spec = llm.config.speculative_config
    if spec is None:
        return {}
    drafts, draft_tokens, accepted = (now - then for now, then in zip(_spec_counts(llm), before))
    return {"speculative_config": spec.to_json(), "spec_decode_drafts": drafts,
            "spec_decode_draft_tokens": draft_tokens, "spec_decode_accepted_tokens": accepted,
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None}


def _bytes_per_block(llm: Any) -> int:
    k_cache, _ = llm.worker.kv_caches[0]
    per_layer = k_cache[0].numel() * k_cache.element_size() * 2  # K and V of one block
    return per_layer * len(llm.worker.kv_caches)


def format_throughput(result: dict[str, Any]) -> str:
    """A short human-readable report of one run."""
    lines = [
        f"pagedserve offline throughput ({result['workload'] or 'workload'}: {result['requests']} requests, "
        f"{result['prompt_tokens']} prompt + {result['output_tokens']} output tokens)",
        f"  elapsed              {result['elapsed_s']:.2f} s",
        f"  output tokens/s      {result['output_tokens_per_s']:.1f}",
        f"  total tokens/s       {result['total_tokens_per_s']:.1f}",
        f"  requests/s           {result['requests_per_s']:.2f}",
        f"  sampling             {_sampling_text(result['sampling'])}",
        f"  steps                {result['steps']}",
        f"  scheduler ms/step    {result['scheduler_ms_per_step']:.3f}  "
        f"({100 * result['scheduler_share']:.1f}% of the run)",
        f"  worker ms/step       {result['execute_ms_per_step']:.2f}",
        f"  model                {result['dtype']}"
        + (f" (KV cache {result['kv_cache_dtype']})" if result["kv_cache_dtype"] != result["dtype"] else "") + ", "
        + (f"compiled in {result['compile_s']:.1f} s" if result["compiled"] else "eager")
        + f", {result['threads']} threads",
        f"  peak KV cache used   {result['peak_kv_gib']:.3f} GiB ({result['peak_kv_blocks']} blocks); "
        f"peak RSS {result['peak_rss_gib']:.2f} GiB",
    ]
    if "speculative_config" in result:
        accepted = result["mean_accepted_length"]
        lines.append(f"  speculative          {result['speculative_config']}: {result['spec_decode_drafts']} steps "
                     f"with drafts, {result['spec_decode_accepted_tokens']} of {result['spec_decode_draft_tokens']} "
                     f"drafts accepted, mean accepted length {accepted if accepted is not None else '-'}")
    return "\n".join(lines)


def _sampling_text(sampling: dict[str, Any]) -> str:
    if sampling["temperature"] == 0:
        return "greedy"
    text = f"temperature {sampling['temperature']:g}, top_p {sampling['top_p']:g}, top_k {sampling['top_k']}"
    return text + (f", seed {sampling['seed']}" if sampling["seed"] is not None else "")


def add_lora_bench_args(parser) -> None:
    from frontend.lora_modules import add_lora_module_args

    add_lora_module_args(parser)  # with --enable-lora: requests run on these adapters in turn
    parser.add_argument("--lora-fraction", type=float, default=1.0,
                        help="with --lora-modules: the share of requests on an adapter, spread evenly (default 1)")


def bench_loras(modules: list[tuple[str, str]], fraction: float, count: int) -> list | None:
    """Request i's LoRARequest: a `fraction` of the requests, spread evenly, on the adapters in
    turn; None without adapters."""
    if not modules:
        return None
    import os

    from common.lora_request import LoRARequest

    adapters = [LoRARequest(name, i + 1, os.path.abspath(path)) for i, (name, path) in enumerate(modules)]
    chosen = [i for i in range(count) if int((i + 1) * fraction) > int(i * fraction)]
    loras: list = [None] * count
    for n, i in enumerate(chosen):
        loras[i] = adapters[n % len(adapters)]
    return loras
