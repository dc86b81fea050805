"""BERT-style encoders: a tiny random `BertModel` served by the encoder worker gives the
vectors sentence-transformers computes from the same local modules (Transformer + mean
Pooling + Normalize), cosine >= 0.9999 in float32; the scheduler runs whole prompts
(never chunked, no prefix-cache hits) and rejects one longer than the step's token budget."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from common.errors import InvalidRequestError
from common.pooling_params import PoolingParams
from tiny_encoders import BERT_HIDDEN, add_sentence_transformers_files, build_tiny_bert, sentence_transformer

TEXTS = ["hello world", "the paged attention cache is in blocks", "bert",
         "a mean pool of the token vector and the encoder model " * 3]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-bert")
    build_tiny_bert(directory)
    add_sentence_transformers_files(directory, BERT_HIDDEN)
    return directory


@pytest.fixture(scope="module")
def reference(bert_dir):
    return sentence_transformer(bert_dir, BERT_HIDDEN)


@pytest.fixture(scope="module")
def llm(bert_dir):
    from pagedserve.offline.llm import LLM

    # A 40-token budget: the long text fills a step alone; the short ones share steps.
    return LLM(model=str(bert_dir), dtype="float32", device="cpu", max_num_batched_tokens=40, block_size=4)


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_bert_embed_equals_sentence_transformers(llm, reference):
    assert llm.scheduler.pooler.bidirectional and llm.scheduler.pooler.pooling_type == "MEAN"
    want = reference.encode(TEXTS, convert_to_numpy=True)
    outputs = llm.embed(TEXTS + TEXTS[:2])  # the repeats find no prefix cache: an encoder has none
    for i, out in enumerate(outputs):
        assert cosine(out.outputs.embedding, want[i % len(TEXTS)]) >= 0.9999
        assert np.allclose(out.outputs.embedding, want[i % len(TEXTS)], atol=1e-5)
        assert out.num_cached_tokens == 0
    ids = reference.tokenize(TEXTS)["input_ids"]
    assert outputs[1].prompt_token_ids == [t for t in ids[1].tolist() if t != 0]


def test_bert_pooling_overrides_and_limits(bert_dir, reference, llm):
    from pagedserve.offline.llm import LLM

    cls = LLM(model=str(bert_dir), dtype="float32", device="cpu", pooler_config={"pooling_type": "CLS",
                                                                               "normalize": False})
    features = reference.tokenize([TEXTS[1]])
    with torch.no_grad():
        hidden = reference[0].auto_model(**features).last_hidden_state[0]
    got = cls.embed([TEXTS[1]])[0].outputs.embedding
    assert np.allclose(got, hidden[0].numpy(), atol=1e-5)
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        llm.embed([[5] * 41])  # longer than one step's budget: an encoder cannot chunk it
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        cls.embed([[5] * 65])
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        llm.embed(["hello"], PoolingParams(dimensions=8))
    with pytest.raises(InvalidRequestError, match="does not generate"):
        llm.generate(["hello"], use_tqdm=False)
