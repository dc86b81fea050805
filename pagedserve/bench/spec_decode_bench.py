"""`pagedserve bench spec-decode`: the same workload with and without speculative decoding,
side by side in one process, at each concurrency asked.

Two engines are built from one config, one with the speculative config and one without.
At each concurrency c (max_num_seqs = c, every request queued at once, as a client
keeping c requests in flight) the runs alternate between them `repeat` times. Each run
records every request's inter-token latency per token (a step that brings m tokens after
a gap g counts m gaps of g / m) and the output throughput; the report has the medians
over the runs, their ratios, and the mean accepted length (tokens a step with drafts
gains per request: the accepted drafts plus the model's own token).
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from common.config import EngineConfig
from pagedserve.bench.throughput import SamplingChoice
from pagedserve.bench.workloads import BenchRequest


def _run(llm: Any, requests: list[BenchRequest], concurrency: int, sampling: SamplingChoice) -> dict[str, Any]:
    llm.scheduler.max_num_seqs = concurrency
    llm.scheduler.reset_prefix_cache()  # every run computes its prompts
    stats = llm.scheduler.spec_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [sampling.params(r.max_tokens) for r in requests]
    gc.collect()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    drafts, draft_tokens, accepted = (now - then for now, then in zip(
        (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
    itl = llm.loop_stats.itl_s
    return {"elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed,
            "median_itl_ms": statistics.median(itl) * 1e3 if itl else 0.0,
            "mean_itl_ms": statistics.fmean(itl) * 1e3 if itl else 0.0,
            "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "token_ids": [o.outputs[0].token_ids for o in outputs]}


def run_spec_decode(config: EngineConfig, requests: list[BenchRequest], concurrencies: list[int], *,
                    repeat: int = 2, sampling: SamplingChoice = SamplingChoice(),
                    workload_name: str = "") -> dict[str, Any]:
    from pagedserve.offline.llm import LLM

    if config.speculative_config is None:
        raise ValueError("bench spec-decode needs --speculative-config")
    size = max(concurrencies)
    engines = {"off": LLM.from_config(config.replace(speculative_config=None, max_num_seqs=size),
                                      skip_tokenizer_init=True),
               "on": LLM.from_config(config.replace(max_num_seqs=size), skip_tokenizer_init=True)}
    for llm in engines.values():  # compile and warm both before any timed run
        llm.record_itl = True
        _run(llm, requests[:1], 1, SamplingChoice())
    rows = []
    for concurrency in concurrencies:
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for _ in range(repeat):
            for name, llm in engines.items():
                runs[name].append(_run(llm, requests, concurrency, sampling))
        off, on = runs["off"], runs["on"]
        med = {name: {key: statistics.median(r[key] for r in rs) for key in
                      ("median_itl_ms", "mean_itl_ms", "output_tokens_per_s")} for name, rs in runs.items()}
        drafts = sum(r["drafts"] for r in on)
        accepted = sum(r["accepted_tokens"] for r in on)
        draft_tokens = sum(r["draft_tokens"] for r in on)
        rows.append({
            "concurrency": concurrency,
            "median_itl_ms_off": round(med["off"]["median_itl_ms"], 3),
            "median_itl_ms_on": round(med["on"]["median_itl_ms"], 3),
            "itl_ratio": round(med["off"]["median_itl_ms"] / med["on"]["median_itl_ms"], 3),
            "mean_itl_ms_off": round(med["off"]["mean_itl_ms"], 3),
            "mean_itl_ms_on": round(med["on"]["mean_itl_ms"], 3),
            "output_tokens_per_s_off": round(med["off"]["output_tokens_per_s"], 2),
            "output_tokens_per_s_on": round(med["on"]["output_tokens_per_s"], 2),
            "throughput_change": round(med["on"]["output_tokens_per_s"] / med["off"]["output_tokens_per_s"] - 1, 4),
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
            "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
            "steps_with_drafts": drafts,
            "same_tokens": all(a["token_ids"] == b["token_ids"] for a, b in zip(off, on)),
        })
    return {"system": "pagedserve", "workload": workload_name, "requests": len(requests),
            "speculative_config": config.speculative_config.to_json(), "dtype": config.resolved_dtype(),
            "sampling": {"temperature": sampling.temperature}, "repeat": repeat, "results": rows}


def run_vllm_spec_decode(vllm_python: str, config: EngineConfig, requests: list[BenchRequest],
                         concurrencies: list[int], repeat: int) -> list[dict[str, Any]]:
    """vLLM's CPU build on the same requests, with and without the same speculative config
    (`vllm_spec_decode_runner.py`, in vLLM's venv); rows shaped like ours."""
    import json
    import os
    import subprocess
    import tempfile

    from common.model_files import resolve_model_dir
    from pagedserve.bench.workloads import save_workload

    script = os.path.join(os.path.dirname(__file__), "vllm_spec_decode_runner.py")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "workload.jsonl")
        save_workload(requests, path)
        proc = subprocess.run([vllm_python, script, "--model", resolve_model_dir(config.model, config.model_cache_dir),
                               "--workload", path, "--speculative-config", config.speculative_config.to_json(),
                               "--concurrency", ",".join(map(str, concurrencies)), "--repeat", str(repeat),
                               "--dtype", config.resolved_dtype()], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM's speculative decoding run failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}")
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rows = []
    for concurrency in concurrencies:
        off, on = ({line["spec"]: line for line in lines if line["concurrency"] == concurrency}[name]
                   for name in ("off", "on"))
        rows.append({"concurrency": concurrency, "version": on["version"],
                     "median_itl_ms_off": round(off["median_itl_ms"], 3), "median_itl_ms_on": round(on["median_itl_ms"], 3),
                     "itl_ratio": round(off["median_itl_ms"] / on["median_itl_ms"], 3),
                     "output_tokens_per_s_off": round(off["output_tokens_per_s"], 2),
                     "output_tokens_per_s_on": round(on["output_tokens_per_s"], 2),
                     "same_tokens": off["token_ids"] == on["token_ids"]})
    return rows


def format_spec_decode(result: dict[str, Any]) -> str:
    lines = [f"speculative decoding {result['speculative_config']} on {result['workload']} "
             f"({result['requests']} requests, {result['dtype']}, medians of {result['repeat']} alternating runs)",
             f"{'concurrency':>11} {'ITL p50 off':>12} {'ITL p50 on':>11} {'ratio':>6} {'tok/s off':>10} "
             f"{'tok/s on':>9} {'change':>7} {'accepted len':>13} {'same tokens':>12}"]
    for r in result["results"]:
        accepted = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] else "-"
        lines.append(f"{r['concurrency']:>11} {r['median_itl_ms_off']:>10.2f}ms {r['median_itl_ms_on']:>9.2f}ms "
                     f"{r['itl_ratio']:>5.2f}x {r['output_tokens_per_s_off']:>10.1f} {r['output_tokens_per_s_on']:>9.1f} "
                     f"{r['throughput_change']:>+7.1%} {accepted:>13} {str(r['same_tokens']):>12}")
    ours = {r["concurrency"]: r for r in result["results"]}
    for r in result.get("vllm", []):
        mine = ours[r["concurrency"]]
        lines.append(f"vLLM {r['version']}, concurrency {r['concurrency']}: ITL p50 {r['median_itl_ms_off']:.2f} ms off, "
                     f"{r['median_itl_ms_on']:.2f} ms on ({r['itl_ratio']:.2f}x), {r['output_tokens_per_s_on']:.1f} tok/s "
                     f"on; pagedserve's ITL with speculation is {r['median_itl_ms_on'] / mine['median_itl_ms_on']:.2f}x "
                     f"lower than vLLM's")
    return "\n".join(lines)
