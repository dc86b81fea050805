"""vLLM's side of `bench spec-decode`: a workload file with and without its speculative
decoding, printing one JSON line per concurrency.

Run by path with the interpreter of a venv that has vLLM's CPU build (imports nothing
from pagedserve):

    <vllm python> vllm_spec_decode_runner.py --model DIR --workload C1.jsonl \
        --speculative-config '{"method": "ngram", ...}' --concurrency 1,4 [--repeat 2]

One engine with the speculative config, one without (each in the process in turn: vLLM
keeps one engine core per LLM). Requests run greedy with ignore_eos, max_num_seqs = the
concurrency, all queued at once; the engine is stepped by hand so each output's arrival is
timed: a step bringing m tokens to a request after a gap g counts m gaps of g / m, as
pagedserve's bench does. Output keys per line: system, version, concurrency, spec
("on"/"off"), median_itl_ms, mean_itl_ms, output_tokens_per_s, token_ids.
"""
import argparse
import gc
import json
import os
import statistics
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--speculative-config", required=True)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gb", default="2")
    return parser.parse_args()


def timed_run(llm, requests, concurrency: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    last, gaps, tokens = {}, [], {}
    started = time.perf_counter()
    for i, r in enumerate(requests):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=r["prompt_token_ids"]),
                           SamplingParams(max_tokens=r["max_tokens"], min_tokens=r["max_tokens"], ignore_eos=True,
                                          temperature=0.0))
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            ids = out.outputs[0].token_ids
            new = len(ids) - len(tokens.get(out.request_id, ()))
            if new > 0:
                if out.request_id in last:
                    gaps.extend([(now - last[out.request_id]) / new] * new)
                last[out.request_id] = now
                tokens[out.request_id] = list(ids)
    elapsed = time.perf_counter() - started
    count = sum(len(t) for t in tokens.values())
    return {"median_itl_ms": statistics.median(gaps) * 1e3, "mean_itl_ms": statistics.fmean(gaps) * 1e3,
            "output_tokens_per_s": count / elapsed,
            "token_ids": [tokens[str(i)] for i in range(len(requests))]}


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_cache_gb)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{len(os.sched_getaffinity(0)) - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    import vllm
    from vllm import LLM

    with open(args.workload) as f:
        requests = [json.loads(line) for line in f if line.strip()]
    spec = json.loads(args.speculative_config)
    spec.pop("disable_by_batch_size", None)  # pagedserve's key; vLLM has none by that name
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        for name, extra in (("off", {}), ("on", {"speculative_config": spec})):
            # max_num_seqs is fixed when the engine starts: one engine per concurrency and setting.
            llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                      max_num_seqs=concurrency, **extra)
            timed_run(llm, requests[:1], concurrency)  # warm-up
            runs = [timed_run(llm, requests, concurrency) for _ in range(args.repeat)]
            print(json.dumps({"system": "vllm", "version": vllm.__version__, "concurrency": concurrency,
                              "spec": name, **{k: statistics.median(r[k] for r in runs) for k in
                                               ("median_itl_ms", "mean_itl_ms", "output_tokens_per_s")},
                              "token_ids": runs[0]["token_ids"]}), flush=True)
            del llm
            gc.collect()


if __name__ == "__main__":
    main()
