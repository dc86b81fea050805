"""Embeddings as a user gets them: `pagedserve serve --runner pooling` (the real process split)
on a tiny random Llama that carries sentence-transformers files (mean pooling + Normalize)
answers the openai client's `embeddings.create` and gRPC Embed with transformers' hidden
states pooled the same way (cosine >= 0.9999, float32), as does the offline LLM.embed; bad input is a 400 in OpenAI's error shape. A tiny random BERT
served the same way (the encoder worker) matches sentence-transformers too."""
from __future__ import annotations

import base64
import json

import grpc
import numpy as np
import openai
import pytest

from common.grpc_gen import pagedserve_pb2 as pb
from common.grpc_gen import pagedserve_pb2_grpc as pb_grpc
from serve_helpers import metric_samples, running_server
from tiny_encoders import BERT_HIDDEN, add_sentence_transformers_files, build_tiny_bert, sentence_transformer
from tiny_models import build_tiny_llama_with_smollm2_tokenizer

TEXTS = ["Hello world", "Paged attention keeps the KV cache in blocks.", "a",
         "Embeddings: " + "the same words again and again " * 6]
HIDDEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-embed")
    build_tiny_llama_with_smollm2_tokenizer(directory)
    add_sentence_transformers_files(directory, HIDDEN)
    return directory


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' LlamaModel over the same directory: last_hidden_state, mean-pooled and
    L2-normalised, as its modules.json says. (sentence-transformers 6 would wrap a decoder's
    text in its chat template first; the BERT test below uses sentence-transformers itself.)"""
    import torch
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def embed(text: str) -> tuple[np.ndarray, int]:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden.mean(0), dim=-1).numpy(), len(ids)
    return embed


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory, model_dir):
    with running_server(tmp_path_factory.mktemp("serve-embed"), [
            "--model", str(model_dir), "--runner", "pooling", "--enforce-eager", "--disable-log-stats",
            "--max-num-batched-tokens", "16"]) as srv:  # the longest text runs in several chunks
        yield srv


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_openai_client_embeddings_equal_transformers_pooling(embed_server, reference):
    client = openai.OpenAI(base_url=embed_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.embeddings.create(model=client.models.list().data[0].id, input=TEXTS, encoding_format="float")
    assert [d.index for d in reply.data] == list(range(len(TEXTS)))
    total = 0
    for text, item in zip(TEXTS, reply.data):
        want, num_tokens = reference(text)
        total += num_tokens
        assert len(item.embedding) == HIDDEN
        assert cosine(item.embedding, want) >= 0.9999
        assert np.allclose(item.embedding, want, atol=1e-4)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == total
    # base64 (the openai client's default) decodes to the same float32 vector as "float" for the
    # same single input (alone, not in a batch: a batch's matmul shapes may round differently).
    alone = client.embeddings.create(model=reply.model, input=TEXTS[1], encoding_format="float")
    assert cosine(alone.data[0].embedding, reply.data[1].embedding) >= 0.99999
    encoded = client.embeddings.create(model=reply.model, input=TEXTS[1])
    assert np.allclose(encoded.data[0].embedding, alone.data[0].embedding, rtol=0, atol=0)
    raw = client.with_raw_response.embeddings.create(model=reply.model, input=TEXTS[1], encoding_format="base64")
    vector = np.frombuffer(base64.b64decode(json.loads(raw.text)["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(vector, np.asarray(alone.data[0].embedding, dtype=np.float32))
    # Token arrays, one or several.
    tokens = client.embeddings.create(model=reply.model, input=[[5, 6, 7], [8, 9]])
    single = client.embeddings.create(model=reply.model, input=[5, 6, 7])
    assert np.allclose(tokens.data[0].embedding, single.data[0].embedding, atol=1e-6)
    assert tokens.usage.prompt_tokens == 5
    samples = metric_samples(embed_server)
    assert samples['pagedserve:embedding_requests_total'] >= len(TEXTS) + 5


@pytest.mark.parametrize("body,match", [
    ({"input": ""}, "empty"), ({"input": []}, "empty"), ({"input": [[]]}, "empty"),
    ({"input": 5}, "input"), ({"input": [1.5]}, "input"), ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 8}, "Matryoshka"), ({"input": [7] * 600}, "context length"),
    ({"input": [300000]}, "vocabulary")])
def test_bad_embedding_requests_are_400(embed_server, body, match):
    import httpx

    response = httpx.post(embed_server.base_url + "/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and match in error["message"] + str(error["param"])


def test_pooling_server_refuses_generation(embed_server):
    import httpx

    response = httpx.post(embed_server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                          timeout=60)
    assert response.status_code == 400 and "does not generate" in response.json()["error"]["message"]


def test_grpc_embed_equals_transformers_pooling(embed_server, reference):
    stub = pb_grpc.PagedServeStub(grpc.insecure_channel(f"127.0.0.1:{embed_server.grpc_port}"))
    reply = stub.Embed(pb.EmbedRequest(texts=TEXTS[:2]), timeout=120)
    assert [e.index for e in reply.embeddings] == [0, 1]
    for text, item in zip(TEXTS, reply.embeddings):
        want, num_tokens = reference(text)
        assert cosine(list(item.values), want) >= 0.9999 and item.prompt_tokens == num_tokens
    assert reply.usage.prompt_tokens == sum(e.prompt_tokens for e in reply.embeddings)
    by_ids = stub.Embed(pb.EmbedRequest(token_ids=[pb.TokenIds(ids=[5, 6, 7])], normalize=False), timeout=120)
    assert abs(float(np.linalg.norm(list(by_ids.embeddings[0].values))) - 1.0) > 1e-3  # not normalised
    with pytest.raises(grpc.RpcError) as error:
        stub.Embed(pb.EmbedRequest(texts=["x"], dimensions=8), timeout=60)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Matryoshka" in error.value.details()


def test_offline_embed_equals_transformers_pooling(model_dir, reference):
    from pagedserve.offline.llm import LLM

    llm = LLM(model=str(model_dir), runner="pooling", dtype="float32", kv_cache_memory=1 << 28, enforce_eager=True)
    for text, out in zip(TEXTS, llm.embed(TEXTS)):
        want, num_tokens = reference(text)
        assert cosine(out.outputs.embedding, want) >= 0.9999 and len(out.prompt_token_ids) == num_tokens


def test_served_bert_equals_sentence_transformers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-bert-serve")
    build_tiny_bert(directory)
    add_sentence_transformers_files(directory, BERT_HIDDEN)
    texts = ["hello world", "the paged attention cache is in blocks", "bert"]
    want = sentence_transformer(directory, BERT_HIDDEN).encode(texts, convert_to_numpy=True)
    with running_server(tmp_path_factory.mktemp("serve-bert"), [  # BertModel: --runner auto pools
            "--model", str(directory), "--disable-log-stats"]) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.embeddings.create(model=client.models.list().data[0].id, input=texts)
        for item, expected in zip(reply.data, want):
            assert cosine(item.embedding, expected) >= 0.9999
        stub = pb_grpc.PagedServeStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))
        by_grpc = stub.Embed(pb.EmbedRequest(texts=texts[:1]), timeout=120)
        assert cosine(list(by_grpc.embeddings[0].values), want[0]) >= 0.9999
