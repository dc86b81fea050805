"""C1, a copy-heavy workload of real text: what speculative decoding is for.

Half the requests ask to fix the typos in a paragraph of *Persuasion* (typos put in
with a seeded generator: letters swapped, doubled or dropped); half ask to rewrite a
Python function from this project with its first argument renamed. Each prompt is the
default model's chat template around the task; each request's max_tokens is the length
of the text to give back, so the output is mostly the copy (benchmarks run greedy
with ignore_eos). Prompts are token ids of the given tokenizer, so every system under
test runs the same ones.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

DATA = Path(__file__).parent / "data"
NUM_PARAGRAPHS = 8
MIN_PARAGRAPH_CHARS = 500
MAX_PARAGRAPH_CHARS = 1200


def paragraphs() -> list[str]:
    """The novel's longer paragraphs, each on one line."""
    text = (DATA / "persuasion_ch1-2.txt").read_text()
    found = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    return [p for p in found if MIN_PARAGRAPH_CHARS <= len(p) <= MAX_PARAGRAPH_CHARS][:NUM_PARAGRAPHS]


def functions() -> list[str]:
    return [f.strip("\n") + "\n" for f in (DATA / "copy_edit_code.txt").read_text().split("\n# ----\n")]


def add_typos(text: str, rng: random.Random, rate: float = 0.08) -> str:
    """About `rate` of the longer words get one typo: two letters swapped, one doubled, or one dropped."""
    def typo(match: re.Match) -> str:
        word = match.group(0)
        if rng.random() >= rate:
            return word
        i = rng.randrange(1, len(word) - 1)
        kind = rng.randrange(3)
        if kind == 0:
            return word[:i] + word[i + 1] + word[i] + word[i + 2:]
        if kind == 1:
            return word[:i] + word[i] + word[i:]
        return word[:i] + word[i + 1:]
    return re.sub(r"[A-Za-z]{4,}", typo, text)


def first_argument(code: str) -> str:
    match = re.search(r"def \w+\((?:self, )?(\w+)", code)
    if match is None:
        raise ValueError("no argument to rename")
    return match.group(1)


def copy_tasks(seed: int = 0) -> list[tuple[str, str]]:
    """(user message, the text the answer copies) for every task, interleaved."""
    rng = random.Random(seed)
    typo_tasks = [(f"Fix the typos in this paragraph. Reply with the corrected paragraph only.\n\n"
                   f"{add_typos(p, rng)}", p) for p in paragraphs()]
    code_tasks = []
    for code in functions():
        old = first_argument(code)
        new = f"{old}_value"
        code_tasks.append((f"Rewrite this Python function with the argument `{old}` renamed to `{new}`. "
                           f"Reply with the code only.\n\n```python\n{code}```",
                           re.sub(rf"\b{old}\b", new, code)))
    return [task for pair in zip(typo_tasks, code_tasks) for task in pair]


def copy_workload_requests(tokenizer, seed: int = 0) -> list[tuple[list[int], int]]:
    """C1 for `tokenizer` (one with a chat template): (prompt token ids, max_tokens) per request."""
    from common.tokenizer import apply_chat_template

    requests = []
    for message, answer in copy_tasks(seed):
        prompt = apply_chat_template(tokenizer, [{"role": "user", "content": message}])
        requests.append((prompt, len(tokenizer.encode(answer, add_special_tokens=False))))
    return requests
