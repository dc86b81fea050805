"""The .gguf tensor directory read without the metadata arrays equals gguf's GGUFReader."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from worker.quantization.gguf_directory import read_gguf_directory


def assert_same_as_gguf_reader(path: str) -> None:
    directory = read_gguf_directory(path)
    reader = GGUFReader(path)
    assert list(directory.tensors) == [t.name for t in reader.tensors]
    for expected in reader.tensors:
        tensor = directory.tensors[expected.name]
        assert tensor.tensor_type == expected.tensor_type
        assert tensor.shape == tuple(int(d) for d in expected.shape)
        assert tensor.data.dtype == expected.data.dtype and tensor.data.shape == expected.data.shape
        assert np.array_equal(tensor.data, expected.data)
    scalars = {key: field.contents() for key, field in reader.fields.items()
               if not key.startswith("GGUF.") and field.types[0] != GGUFValueType.ARRAY}
    assert directory.metadata == scalars


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_every_value_type_and_tensor_kind(tmp_path, endianess):
    path = str(tmp_path / "model.gguf")
    writer = GGUFWriter(path, "llama", endianess=endianess)
    writer.add_string("general.name", "tiny ✓")
    writer.add_uint32("general.alignment", 64)
    writer.add_key_value("some.float", 0.25, GGUFValueType.FLOAT32)
    writer.add_key_value("some.flag", True, GGUFValueType.BOOL)
    writer.add_key_value("some.int64", -7, GGUFValueType.INT64)
    writer.add_key_value("some.float64", 1.5, GGUFValueType.FLOAT64)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "", "ccc"] * 50)
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0])
    writer.add_array("nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, 64)).astype(np.float32))
    writer.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float16))
    weights = rng.standard_normal((16, 64)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_down.weight", quantize(weights, GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_reader(path)
    directory = read_gguf_directory(path)
    assert directory.metadata["general.name"] == "tiny ✓" and directory.metadata["general.architecture"] == "llama"
    assert directory.tensors["blk.0.ffn_down.weight"].shape == (64, 16)


def test_the_default_models_file():
    from common.model_files import smollm2_gguf_path
    assert_same_as_gguf_reader(smollm2_gguf_path())


def test_a_file_that_is_not_gguf(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_directory(str(junk))
