"""Pooling settings: --pooler-config parsing, the defaults a model's sentence-transformers files
give, and how a request's dimensions/normalize resolve against the worker's pooler."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from common.config import EngineConfig
from common.errors import ConfigError, InvalidRequestError
from common.pooling_params import PoolerConfig, PoolerInfo, PoolingParams, model_pooler_defaults


def test_pooler_config_parses_and_refuses_bad_values():
    assert PoolerConfig.parse('{"pooling_type": "mean", "normalize": false}') == PoolerConfig(
        pooling_type="MEAN", normalize=False)
    assert EngineConfig(device="cpu", pooler_config={"pooling_type": "CLS"}).pooler_config.pooling_type == "CLS"
    for bad, message in (("{", "not valid JSON"), ('{"pooling_type": "MAX"}', "pooling_type must be one of"),
                         ('{"pool": "LAST"}', "pooler_config"), ("[1]", "JSON object")):
        with pytest.raises(ConfigError, match=message):
            PoolerConfig.parse(bad)
    with pytest.raises(ConfigError, match="runner must be one of"):
        EngineConfig(device="cpu", runner="embed")


@pytest.mark.parametrize("mode,normalize,expected", [
    ("pooling_mode_lasttoken", True, "LAST"), ("pooling_mode_mean_tokens", False, "MEAN"),
    ("pooling_mode_cls_token", True, "CLS")])
def test_sentence_transformers_files_decide_the_default(tmp_path, mode, normalize, expected):
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({mode: True}))
    decoder = SimpleNamespace(architectures=["LlamaForCausalLM"])
    assert model_pooler_defaults(str(tmp_path), decoder) == (expected, normalize)


def test_defaults_without_sentence_transformers_files(tmp_path):
    assert model_pooler_defaults(str(tmp_path), SimpleNamespace(architectures=["Qwen3ForCausalLM"])) == ("LAST", True)
    assert model_pooler_defaults(str(tmp_path), SimpleNamespace(architectures=["BertModel"])) == ("CLS", True)


def test_request_parameters_resolve_against_the_pooler():
    plain = PoolerInfo(pooling_type="LAST", normalize=True, hidden_size=64)
    assert plain.resolve(PoolingParams()) == PoolingParams(normalize=True, pooling_type="LAST")
    assert plain.resolve(PoolingParams(dimensions=64, normalize=False)).dimensions is None
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        plain.resolve(PoolingParams(dimensions=32))
    listed = PoolerInfo(pooling_type="MEAN", normalize=False, hidden_size=64, is_matryoshka=True,
                        matryoshka_dimensions=[16, 32])
    assert listed.resolve(PoolingParams(dimensions=16)).dimensions == 16
    for dims, message in ((20, "one of"), (128, "more than"), (0, "positive")):
        with pytest.raises(InvalidRequestError, match=message):
            listed.resolve(PoolingParams(dimensions=dims))
