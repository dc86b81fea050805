"""`pagedserve generate` as a newcomer runs it: only the generated text on stdout."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generate_chat_answers_paris_on_stdout_only():
    # float32: the first token is a near tie ("The" 25.33 vs "L" 25.24 in float32 logits), which
    # bfloat16 rounding (steps of 0.125 there) decides by luck; float32 is the exact reference.
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "generate", "--chat", "--prompt", "What is the capital of France?",
         "--dtype", "float32"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout
    assert result.stdout.count("\n") <= 3, "logs or progress bars leaked onto stdout"


def test_generate_reports_bad_flags_clearly():
    result = subprocess.run([sys.executable, "-m", "pagedserve.cli", "generate", "--prompt", "hi", "--dtype", "int3"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "dtype" in result.stderr and result.stdout == ""
