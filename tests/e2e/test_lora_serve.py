"""Issue 50 acceptance over HTTP: `pagedserve serve --enable-lora --lora-modules` on a tiny
Llama; one adapter given at start, one loaded at run time; 8 concurrent requests mixing both
adapters and the base model each get transformers + peft's greedy tokens; unloading works;
unknown names and bad paths are OpenAI errors."""
from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from peft_adapters import ALL_LINEAR, build_peft_adapter, peft_reference
from serve_helpers import running_server
from tiny_models import build_tiny_llama_with_smollm2_tokenizer, hf_greedy

NEW_TOKENS = 10


def test_mixed_adapters_over_http_match_peft(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    build_tiny_llama_with_smollm2_tokenizer(base)
    build_peft_adapter(base, tmp_path / "attn", rank=8, targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=1)
    build_peft_adapter(base, tmp_path / "full", rank=4, targets=ALL_LINEAR, seed=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 9, 13, 7, 5, 17, 9, 6)]
    models = [str(base), "attn", "full", "attn", "full", str(base), "full", "attn"]
    env = {**os.environ, "PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    (tmp_path / "srv").mkdir()
    with running_server(tmp_path / "srv", ["--model", str(base), "--enforce-eager", "--disable-log-stats",
                                           "--kv-cache-memory", "128MiB", "--enable-lora", "--max-loras", "2",
                                           "--max-lora-rank", "8", "--lora-modules", f"attn={tmp_path / 'attn'}"],
                        env=env) as server:
        http = httpx.Client(base_url=server.base_url, timeout=120)
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "full", "lora_path": str(tmp_path / "full")})
        assert loaded.status_code == 200, loaded.text
        cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
        assert cards["attn"]["parent"] == cards["full"]["parent"] == str(base)

        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(i: int) -> list[int]:
            reply = client.completions.create(model=models[i], prompt=prompts[i], temperature=0,
                                              max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True,
                                                                                 "return_token_ids": True})
            return reply.choices[0].model_extra["token_ids"]

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, range(8)))

        with openai_error(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x", max_tokens=1)
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "none")})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "full"}).status_code == 200
        with openai_error(openai.NotFoundError):
            client.completions.create(model="full", prompt="x", max_tokens=1)

    for name in (str(base), "attn", "full"):
        reference = peft_reference(base, None if name == str(base) else tmp_path / name)
        for prompt, tokens, model in zip(prompts, got, models):
            if model == name:
                assert tokens == hf_greedy(reference, prompt, NEW_TOKENS), (name, prompt)


class openai_error:
    def __init__(self, kind):
        self.kind = kind

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        assert kind is not None and issubclass(kind, self.kind), f"expected {self.kind.__name__}, got {kind}"
        return True
