"""BERT-style encoders: a tiny random `BertModel` served by the encoder worker gives the
vectors sentence-transformers computes from the same local modules (Transformer + mean
Pooling + Normalize), cosine >= 0.9999 in float32; the scheduler runs whole prompts
(never chunked, no prefix-cache hits) and rejects one longer than the step's token budget."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from common.errors import InvalidRequestError
from common.pooling_params import PoolingParams

WORDS = ["hello", "world", "paged", "attention", "blocks", "cache", "the", "a", "of", "embed", "vector",
         "token", "model", "encoder", "bert", "mean", "pool", "is", "and", "in"]
TEXTS = ["hello world", "the paged attention cache is in blocks", "bert",
         "a mean pool of the token vector and the encoder model " * 3]
HIDDEN = 32


def build_tiny_bert(directory, seed: int = 0) -> None:
    """A random float32 transformers BertModel with a WordPiece tokenizer, saved to `directory`."""
    import transformers

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(str(directory / "vocab.txt")).save_pretrained(directory)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=HIDDEN, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=48, max_position_embeddings=64,
                                     initializer_range=0.2)
    config.architectures = ["BertModel"]
    torch.manual_seed(seed)
    model = transformers.BertModel(config)
    with torch.no_grad():  # LayerNorm weights and biases random too (HF's 1/0 would hide their misuse)
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.3 * torch.randn_like(param) if "LayerNorm.weight" in name
                            else 0.3 * torch.randn_like(param))
    model.save_pretrained(directory)


def add_mean_pooling_files(directory) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "2_Normalize").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": HIDDEN, "pooling_mode_mean_tokens": True}))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-bert")
    build_tiny_bert(directory)
    add_mean_pooling_files(directory)
    return directory


@pytest.fixture(scope="module")
def sentence_transformer(bert_dir):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    return SentenceTransformer(modules=[Transformer(str(bert_dir)), Pooling(HIDDEN, "mean"), Normalize()], device="cpu")


@pytest.fixture(scope="module")
def llm(bert_dir):
    from pagedserve.offline.llm import LLM

    # A 40-token budget: the long text fills a step alone; the short ones share steps.
    return LLM(model=str(bert_dir), dtype="float32", device="cpu", max_num_batched_tokens=40, block_size=4)


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_bert_embed_equals_sentence_transformers(llm, sentence_transformer):
    assert llm.scheduler.pooler.bidirectional and llm.scheduler.pooler.pooling_type == "MEAN"
    want = sentence_transformer.encode(TEXTS, convert_to_numpy=True)
    outputs = llm.embed(TEXTS + TEXTS[:2])  # the repeats find no prefix cache: an encoder has none
    for i, out in enumerate(outputs):
        assert cosine(out.outputs.embedding, want[i % len(TEXTS)]) >= 0.9999
        assert np.allclose(out.outputs.embedding, want[i % len(TEXTS)], atol=1e-5)
        assert out.num_cached_tokens == 0
    ids = sentence_transformer.tokenize(TEXTS)["input_ids"]
    assert outputs[1].prompt_token_ids == [t for t in ids[1].tolist() if t != 0]


def test_bert_pooling_overrides_and_limits(bert_dir, sentence_transformer, llm):
    from pagedserve.offline.llm import LLM

    cls = LLM(model=str(bert_dir), dtype="float32", device="cpu", pooler_config={"pooling_type": "CLS",
                                                                               "normalize": False})
    features = sentence_transformer.tokenize([TEXTS[1]])
    with torch.no_grad():
        hidden = sentence_transformer[0].auto_model(**features).last_hidden_state[0]
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
