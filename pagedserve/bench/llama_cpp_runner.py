"""Run llama.cpp (through llama-cpp-python) on a workload file and print one JSON result line.

`bench compare --llama-cpp-python PY` runs this file by path with the
interpreter of a venv that has llama-cpp-python
(scripts/install_llama_cpp_python.sh makes one), so it imports nothing from
pagedserve, only llama_cpp, numpy and the standard library:

    <llama-cpp python> llama_cpp_runner.py --model FILE.gguf --workload W.jsonl [--threads N]

W.jsonl holds one request a line, {"prompt_token_ids": [...], "max_tokens": N}.
Each request's prompt goes in as token ids; then exactly max_tokens greedy
tokens are decoded, EOS included (the argmax of the logits, fed back one by
one), as pagedserve's and vLLM's runs ignore EOS. Requests run one after the
other in one context: llama-cpp-python's Llama object holds one sequence.
n_threads and n_threads_batch are the cores pagedserve would use. Output keys
as vllm_offline_runner.py's, plus threads.
"""
import argparse
import json
import os
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a .gguf file")
    parser.add_argument("--workload", required=True, help="JSONL workload file")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="n_threads and n_threads_batch (default: this process's cores)")
    parser.add_argument("--n-batch", type=int, default=512, help="prompt tokens per llama_decode call")
    return parser.parse_args()


def greedy(llm, prompt: list, max_tokens: int) -> list:
    """Exactly max_tokens argmax tokens after `prompt` (a fresh sequence)."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    n_vocab = llm.n_vocab()
    out = []
    for _ in range(max_tokens):
        # Llama.eval keeps no logits unless logits_all: read the last token's row from the context.
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        token = int(np.argmax(logits))
        out.append(token)
        if len(out) < max_tokens:
            llm.eval([token])
    return out


def main() -> None:
    args = parse_args()
    import llama_cpp

    with open(args.workload) as f:
        requests = [json.loads(line) for line in f if line.strip()]
    n_ctx = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    llm = llama_cpp.Llama(model_path=args.model, n_ctx=n_ctx, n_batch=min(args.n_batch, n_ctx),
                          n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    greedy(llm, requests[0]["prompt_token_ids"][:8], 2)  # warm-up
    started = time.perf_counter()
    outputs = [greedy(llm, r["prompt_token_ids"], r["max_tokens"]) for r in requests]
    elapsed = time.perf_counter() - started
    output_tokens = sum(len(o) for o in outputs)
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    print(json.dumps({"system": "llama.cpp", "version": llama_cpp.__version__, "requests": len(requests),
                      "threads": args.threads, "model": os.path.basename(args.model),
                      "output_tokens": output_tokens, "elapsed_s": round(elapsed, 6),
                      "output_tokens_per_s": round(output_tokens / elapsed, 2),
                      "total_tokens_per_s": round((output_tokens + prompt_tokens) / elapsed, 2),
                      "first_tokens": [o[:8] for o in outputs[:4]]}))


if __name__ == "__main__":
    main()
