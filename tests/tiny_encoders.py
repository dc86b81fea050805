"""Tiny random embedding models for tests: a transformers BertModel with a WordPiece tokenizer,
and the sentence-transformers files (modules.json, the Pooling module's config) that give a
model directory its default pooling."""
from __future__ import annotations

import json
from pathlib import Path

import torch

BERT_WORDS = ["hello", "world", "paged", "attention", "blocks", "cache", "the", "a", "of", "embed", "vector",
              "token", "model", "encoder", "bert", "mean", "pool", "is", "and", "in"]
BERT_HIDDEN = 32


def build_tiny_bert(directory: Path, seed: int = 0) -> None:
    """A random float32 BertModel (hidden 32, 2 layers, 64 positions) and its tokenizer, saved."""
    import transformers

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *BERT_WORDS]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(str(directory / "vocab.txt")).save_pretrained(directory)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=BERT_HIDDEN, num_hidden_layers=2,
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


def add_sentence_transformers_files(directory: Path, hidden_size: int, pooling: str = "mean") -> None:
    """modules.json (Transformer, Pooling, Normalize) and the Pooling module's config."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    (directory / "2_Normalize").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden_size, "pooling_mode_cls_token": pooling == "cls",
         "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_lasttoken": pooling == "lasttoken"}))


def sentence_transformer(directory: Path, hidden_size: int):
    """sentence-transformers built from local modules: Transformer over `directory`, mean Pooling, Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    return SentenceTransformer(modules=[Transformer(str(directory)), Pooling(hidden_size, "mean"), Normalize()],
                               device="cpu")
