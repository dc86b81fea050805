"""transformers `generate` on the GPU, batched, as the baseline of the GPU run: the same model,
dtype and workload as `bench throughput` (W2 by default: every request one output length, so
one static batch per group), greedy, no EOS stop, left-padded prompts.

`python tests/gpu/hf_generate_cuda.py --model DIR [--workload W2] [--dtype bfloat16]` prints one
JSON line with output_tokens_per_s, as the bench records.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    import torch
    import transformers

    from pagedserve.bench.hf_baseline import generate_batch, static_batches
    from pagedserve.bench.workloads import BenchRequest, resolve_workload, workload_summary

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", default="W2")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=getattr(torch, args.dtype), local_files_only=True).to(args.device).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # every row runs to max_new_tokens
    requests = resolve_workload(args.workload, model.config.vocab_size)
    generate_batch(model, [BenchRequest(requests[0].prompt_token_ids[:8], 2)], 0, args.device)  # warm-up
    if args.device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    output_tokens = sum(generate_batch(model, batch, 0, args.device)
                        for batch in static_batches(requests, args.batch_size))
    if args.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    print(json.dumps({"system": "transformers", "version": transformers.__version__, "device": args.device,
                      "workload": args.workload, **workload_summary(requests), "output_tokens": output_tokens,
                      "elapsed_s": round(elapsed, 6), "output_tokens_per_s": round(output_tokens / elapsed, 2),
                      "dtype": args.dtype}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
