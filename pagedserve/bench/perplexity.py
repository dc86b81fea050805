"""`bench perplexity`: the perplexity of an English text through the offline engine.

The text is tokenized by the model's tokenizer and cut into windows of
`window` tokens that start every `stride` tokens; each window is one prompt
with prompt_logprobs=0 (the log-probability of each actual next token), and
each token after the first is scored once, in the first window that holds
it past the previous window's end: with a stride of half the window every
scored token has at least half a window of context. Perplexity is
exp(mean negative log-likelihood) over the scored tokens.

Variants (`--variant NAME="engine flags"`) each run this in a fresh process
(`bench perplexity` without variants), so memory and kernels never leak
between them; the report gives each one's ratio to the first and, with a
tolerance, whether it is within it.
"""
from __future__ import annotations

import math
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "persuasion_ch1-2.txt"


@dataclass(frozen=True, slots=True)
class Window:
    start: int  # first token of the prompt
    end: int  # one past its last token
    score_from: int  # the first token scored in it (earlier ones are context)


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """Windows covering tokens 1..num_tokens-1 exactly once (token 0 has no context)."""
    if window < 2:
        raise ValueError(f"the window must hold at least 2 tokens, got {window}")
    if not 1 <= stride <= window - 1:
        raise ValueError(f"the stride must be between 1 and window - 1 ({window - 1}), got {stride}")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    windows, scored_to, start = [], 1, 0
    while scored_to < num_tokens:
        end = min(start + window, num_tokens)
        windows.append(Window(start, end, scored_to))
        scored_to = end
        start += stride
    return windows


def parse_tolerance(text: str) -> float:
    """"2%" or "0.02" -> 0.02."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"tolerance {text!r} is not a number like 0.02 or 2%") from None
    if not value >= 0:
        raise ValueError(f"tolerance {text!r} must not be negative")
    return value


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'int8=--dtype bfloat16 --quantization int8' -> ("int8", ["--dtype", ...])."""
    name, sep, flags = text.partition("=")
    name = name.strip()
    if not sep or not name or not name.replace("_", "").replace("-", "").replace(".", "").isalnum():
        raise ValueError(f"variant {text!r}: expected NAME=\"engine flags\" with a name of letters, digits, "
                         f"'-', '_' or '.'")
    try:
        return name, shlex.split(flags)
    except ValueError as exc:
        raise ValueError(f"variant {name!r}: cannot split its flags {flags!r}: {exc}") from None


def read_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text


def run_perplexity(config, text_path: str, *, window: int | None, stride: int | None,
                   max_text_tokens: int | None) -> dict[str, Any]:
    """One engine, one text: the perplexity and how it was measured."""
    from common.sampling_params import SamplingParams
    from pagedserve.offline.llm import LLM

    llm = LLM.from_config(config)
    if llm.tokenizer is None:
        raise ValueError(f"model {config.model} has no tokenizer to read the text with")
    token_ids = llm.tokenizer.encode(read_text(text_path), add_special_tokens=False)
    if max_text_tokens:
        token_ids = token_ids[:max_text_tokens]
    window = window or llm.max_model_len - 1  # the prompt and its one sampled token must fit
    if window > llm.max_model_len - 1:
        raise ValueError(f"--window {window} does not fit the model's context ({llm.max_model_len} "
                         f"tokens, one of them for the sampled token)")
    stride = stride or max(1, window // 2)
    windows = sliding_windows(len(token_ids), window, stride)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": token_ids[w.start:w.end]} for w in windows], params,
                           use_tqdm=False)
    elapsed = time.perf_counter() - started
    total_nll, scored = 0.0, 0
    for w, output in zip(windows, outputs):
        positions = output.prompt_logprobs
        for index in range(w.score_from, w.end):
            entry = positions[index - w.start]
            if entry.token_id != token_ids[index]:
                raise RuntimeError(f"prompt logprob at token {index} is for token {entry.token_id}, "
                                   f"expected {token_ids[index]}")
            total_nll -= entry.logprob
            scored += 1
    mean_nll = total_nll / scored
    return {"model": config.model, "dtype": config.dtype, "quantization": config.quantization,
            "kv_cache_dtype": config.kv_cache_dtype, "text": os.path.basename(text_path),
            "text_tokens": len(token_ids), "scored_tokens": scored, "window": window, "stride": stride,
            "windows": len(windows), "mean_nll": round(mean_nll, 6), "perplexity": round(math.exp(mean_nll), 6),
            "elapsed_s": round(elapsed, 3)}


def compare_variants(results: list[dict[str, Any]], tolerances: dict[str, float]) -> dict[str, Any]:
    """Each variant's ratio to the first and, where it has a tolerance, pass/fail."""
    base = results[0]["perplexity"]
    for result in results:
        result["ratio"] = round(result["perplexity"] / base, 6)
        tolerance = tolerances.get(result["variant"])
        result["tolerance"] = tolerance
        result["passed"] = None if tolerance is None else abs(result["ratio"] - 1) <= tolerance
    first = results[0]
    return {"text": first["text"], "scored_tokens": first["scored_tokens"], "window": first["window"],
            "stride": first["stride"], "variants": results,
            "passed": all(r["passed"] is not False for r in results)}


def format_single(result: dict[str, Any]) -> str:
    return (f"perplexity {result['perplexity']:.4f} on {result['text']} ({result['scored_tokens']} tokens scored "
            f"in {result['windows']} windows of {result['window']}, stride {result['stride']}; "
            f"{result['model']}, {result['dtype']}, {result['elapsed_s']:.1f} s)")


def format_variants(report: dict[str, Any]) -> str:
    header = f"{'variant':<16} {'perplexity':>11} {'ratio':>8} {'tolerance':>10}  result"
    lines = [f"perplexity on {report['text']}: {report['scored_tokens']} tokens scored, window {report['window']}, "
             f"stride {report['stride']}; ratios to {report['variants'][0]['variant']}", header, "-" * len(header)]
    for r in report["variants"]:
        tolerance = "-" if r["tolerance"] is None else f"{100 * r['tolerance']:.1f} %"
        verdict = "" if r["passed"] is None else ("pass" if r["passed"] else "FAIL")
        lines.append(f"{r['variant']:<16} {r['perplexity']:>11.4f} {r['ratio']:>8.4f} {tolerance:>10}  {verdict}")
        lines.append(f"{'':<16} flags: {' '.join(r['flags']) or '(none)'}")
    return "\n".join(lines)
