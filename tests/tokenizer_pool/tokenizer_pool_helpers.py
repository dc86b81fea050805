"""Helpers for the tokenizer pool tests: a tiny byte-level BPE tokenizer with a
ChatML template saved as an HF directory, /proc inspection, and a runner for
`python -m tokenizer_pool.tokenizer_pool_cli` as a real process group on free local ports."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from local_ports import free_port

REPO = Path(__file__).resolve().parents[2]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?",
          "naïve café — 日本語 テキスト 🙂", "tokenizer pool router worker job"] * 20


def build_tiny_tokenizer(path: Path, corpus: list[str] = CORPUS) -> Path:
    """A byte-level BPE tokenizer (400 tokens, ChatML template) trained on `corpus`, saved to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHATML)
    fast.save_pretrained(str(path))
    return path


def child_pids(pid: int) -> list[int]:
    """Live (non-zombie) direct children of `pid`, from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, ...
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry))
    return sorted(children)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cpu_ticks(pid: int) -> int:
    """User + system CPU time of `pid` in clock ticks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class PoolProcess:
    """`python -m tokenizer_pool.tokenizer_pool_cli ...` in its own session, stderr kept in a file."""

    def __init__(self, args: list[str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "tokenizer_pool.tokenizer_pool_cli", *args], cwd=REPO,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PAGEDSERVE_LOG_LEVEL": "INFO"})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, pattern: str, count: int = 1, timeout: float = 20.0) -> bool:
        return wait_until(lambda: len(re.findall(pattern, self.log())) >= count, timeout)

    def workers(self) -> list[int]:
        """Child processes titled as tokenizer workers (multiprocessing's
        resource tracker is a child too)."""
        return [pid for pid in child_pids(self.pid) if cmdline(pid).startswith("pagedserve: tokenizer")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def launch_pool(log_dir: Path, extra: list[str], *, name: str = "pool", frontend: str | None = None,
                backend: str | None = None) -> PoolProcess:
    """A pool on the given addresses or fresh local ports (kept in .frontend / .backend)."""
    frontend = frontend or f"tcp://127.0.0.1:{free_port()}"
    backend = backend or f"tcp://127.0.0.1:{free_port()}"
    pool = PoolProcess(["--frontend-address", frontend, "--backend-address", backend, *extra],
                       log_dir / f"{name}-{time.monotonic_ns()}.log")
    pool.frontend, pool.backend = frontend, backend
    return pool
