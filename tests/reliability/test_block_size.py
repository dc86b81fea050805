"""The worker owns the KV cache, so its block size is the one that counts: a
scheduler configured for other blocks follows the worker's and says so."""
from __future__ import annotations

import httpx

from tests.reliability.stack import MODEL_NAME, Stack


def test_the_scheduler_follows_the_workers_block_size(tmp_path):
    stack = Stack(tmp_path, scheduler_args=["--block-size", "128"], worker_args=["--block-size", "16"])
    try:
        stack.wait_healthy()
        for max_tokens in (30, 5):  # 30 tokens cross 16-token block boundaries
            body = {"model": MODEL_NAME, "prompt": "one two three", "max_tokens": max_tokens}
            response = httpx.post(stack.api_url + "/completions", json=body, timeout=30)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == stack.expected_text(max_tokens)
        assert "has KV blocks of 16 tokens, not the 128 configured here: using 16" in stack.scheduler.log()
        stack.wait_all_blocks_free()
    finally:
        stack.stop()
