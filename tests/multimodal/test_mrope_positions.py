"""M-RoPE positions (worker.models.mrope) against transformers' Qwen2-VL: a prompt's 3-D
positions and delta (get_rope_index), the rotary's cos/sin for them, and a step's slice."""
import numpy as np
import pytest
import torch

from common.protocol import ImageInput, TensorData
from common.sampling_params import SamplingParams
from worker.input_batch import RequestState
from worker.models.mrope import MRotaryEmbedding, prompt_mrope_positions, step_mrope_positions

IMAGE_ID = 7


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen2VLConfig, Qwen2VLModel

    text = dict(vocab_size=16, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                        "rope_theta": 10000.0})
    config = Qwen2VLConfig(text_config=text, vision_config=dict(depth=1, embed_dim=8, hidden_size=32, num_heads=2),
                           image_token_id=IMAGE_ID, video_token_id=8, vision_start_token_id=9, vision_end_token_id=10)
    return Qwen2VLModel(config).eval()


def prompt_with_images(grids):
    """Token ids: text, then per image 9 + its placeholders + 10, then text; and the ImageInputs."""
    ids, images = [1, 2, 3], []
    for t, h, w in grids:
        ids.append(9)
        count = t * h * w // 4
        images.append(ImageInput(offset=len(ids), length=count, content_hash="x", grid_thw=[t, h, w],
                                 pixel_values=TensorData(data=b"", dtype="float32", shape=[0])))
        ids += [IMAGE_ID] * count + [10, 4]
    return ids + [5, 6], images


def test_prompt_positions_and_delta_equal_get_rope_index(hf_model):
    grids = [[1, 4, 6], [1, 8, 2]]
    ids, images = prompt_with_images(grids)
    positions, delta = prompt_mrope_positions(len(ids), images, merge_size=2)
    input_ids = torch.tensor([ids])
    expected, expected_delta = hf_model.get_rope_index(input_ids, (input_ids == IMAGE_ID).int(), torch.tensor(grids))
    assert np.array_equal(positions, expected[:, 0].numpy())
    assert delta == int(expected_delta) < 0


def test_rotary_of_3d_positions_equals_transformers(hf_model):
    ids, images = prompt_with_images([[1, 4, 6]])
    positions, _ = prompt_mrope_positions(len(ids), images, merge_size=2)
    config = hf_model.config.text_config
    rotary = MRotaryEmbedding(config, config.hidden_size // config.num_attention_heads)
    rotary.reserve(64, torch.float32, "cpu")
    cos, sin = rotary.lookup(torch.from_numpy(positions))
    ref_cos, ref_sin = hf_model.language_model.rotary_emb(torch.zeros(1), torch.from_numpy(positions)[:, None])
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=1e-6)


def test_a_step_takes_its_chunk_of_the_prompt_and_shifts_later_tokens():
    ids, images = prompt_with_images([[1, 4, 4]])  # 4 placeholders at 4..7, prompt of 12
    state = RequestState("r", ids + [11, 12], len(ids), SamplingParams(), [], 0, images=images)
    state.mrope_positions, state.mrope_delta = prompt_mrope_positions(len(ids), images, merge_size=2)
    other = np.arange(100, 103)  # a text-only request's tokens first: unchanged
    positions = np.concatenate([other, np.arange(2, 8)])
    rows = step_mrope_positions(positions, [(state, 3, 2, 6)], three_d=True)
    assert rows.shape == (3, 9) and (rows[:, :3] == other).all()
    assert np.array_equal(rows[:, 3:], state.mrope_positions[:, 2:8])
    decode = step_mrope_positions(np.array([12, 13]), [(state, 0, 12, 2)], three_d=False)
    assert decode.tolist() == [12 + state.mrope_delta, 13 + state.mrope_delta] and state.mrope_delta == -2
