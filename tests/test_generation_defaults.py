"""The model's generation_config.json sampling defaults (vLLM's --generation-config)."""
from __future__ import annotations

import json

import pytest

from common.errors import ConfigError
from common.generation_defaults import sampling_defaults


def model_dir(tmp_path, config) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_auto_takes_what_differs_from_transformers_defaults(tmp_path):
    directory = model_dir(tmp_path, {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                     "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.0,
                                     "max_new_tokens": 100})
    assert sampling_defaults(directory) == {"temperature": 0.6, "top_p": 0.95, "min_p": 0.05}
    assert sampling_defaults(directory, "vllm") == {}
    assert sampling_defaults(str(tmp_path / "elsewhere")) == {}  # no file: the API's defaults


def test_a_directory_given_is_read_instead_of_the_models(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    model_dir(other, {"top_k": 20, "temperature": 1.0, "repetition_penalty": 1.05})
    assert sampling_defaults("/no/model", str(other)) == {"top_k": 20, "repetition_penalty": 1.05}


@pytest.mark.parametrize("content", ["not json", "[1, 2]"])
def test_an_unreadable_file_is_a_config_error(tmp_path, content):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ConfigError, match="generation_config.json"):
        sampling_defaults(str(tmp_path))


def test_a_directory_without_the_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no generation_config.json"):
        sampling_defaults(None, str(tmp_path))
