"""One real `pagedserve serve` (frontend, tokenizer pool, scheduler, worker;
SmolLM2 in float32) shared by every test of this package, and the clients
and references the tests compare it with."""
from __future__ import annotations


import grpc
import openai
import pytest
import torch

from common.grpc_gen import pagedserve_pb2_grpc as pb_grpc
from serve_helpers import MODEL, metric_samples, running_server  # noqa: F401 (tests import it from here)


@pytest.fixture(scope="package")
def server(tmp_path_factory):
    # Eager: these tests check the API, and the many one-off batch shapes they
    # make would each cost the compiled step a compilation.
    with running_server(tmp_path_factory.mktemp("api-serve"), ["--enforce-eager"]) as srv:
        yield srv


@pytest.fixture(scope="package")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def stub(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield pb_grpc.PagedServeStub(channel)


@pytest.fixture(scope="package")
def model_dir() -> str:
    from common.model_files import resolve_model_dir
    return resolve_model_dir(MODEL)


@pytest.fixture(scope="package")
def tokenizer(model_dir):
    from common.tokenizer import load_tokenizer
    return load_tokenizer(model_dir)


class Reference:
    """transformers' float32 forward pass of the served model."""

    def __init__(self, model_dir: str):
        from transformers import LlamaForCausalLM
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """[len, vocab]: row p is log p(token p + 1 | tokens up to p)."""
        with torch.no_grad():
            return self.model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      do_sample=False, max_new_tokens=num_tokens, pad_token_id=0)
        return out[0, len(prompt):].tolist()


@pytest.fixture(scope="package")
def reference(model_dir) -> Reference:
    return Reference(model_dir)

