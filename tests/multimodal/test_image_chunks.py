"""Which rows of a step take which rows of an image (a chunk may cut the placeholders),
and tensors carried as bytes."""
import numpy as np
import pytest
import torch

from common.protocol import ImageInput, TensorData
from worker.image_embeddings import merged_input_embeddings, plan_image_chunks, tensor_from_data
from worker.input_batch import RequestState
from common.sampling_params import SamplingParams


def state_with_images(*spans):
    state = RequestState("r", list(range(30)), 30, SamplingParams(), [], 0)
    state.images = [ImageInput(offset=o, length=n, content_hash=str(o), pixel_values=TensorData(
        data=np.full((n, 2), o, dtype=np.float32).tobytes(), dtype="float32", shape=[n, 2])) for o, n in spans]
    return state


def test_a_chunk_takes_the_slices_it_covers():
    state = state_with_images((2, 6), (10, 4))
    chunks = plan_image_chunks(state, row=5, first=4, count=8)  # tokens 4..11 at rows 5..12
    assert [(c.image, c.row, c.start, c.end) for c in chunks] == [(0, 5, 2, 6), (1, 11, 0, 2)]
    assert plan_image_chunks(state, row=0, first=14, count=3) == []


class FakeVisionModel:
    """Embeds token t as [t, t]; encodes an image's pixels as themselves plus 100."""

    def __init__(self):
        self.encoded = 0

    def embed(self, ids):
        return ids.float().unsqueeze(1).repeat(1, 2)

    def encode_images(self, pixels):
        self.encoded += 1
        return pixels + 100


def test_merging_encodes_each_image_once_over_its_chunks():
    model, state = FakeVisionModel(), state_with_images((2, 6))
    first = merged_input_embeddings(model, torch.arange(0, 5), plan_image_chunks(state, 0, 0, 5))
    assert first[:, 0].tolist() == [0, 1, 102, 102, 102]
    assert 0 in state.image_embeds  # kept: the image's last placeholders come next chunk
    second = merged_input_embeddings(model, torch.arange(5, 10), plan_image_chunks(state, 0, 5, 5))
    assert second[:, 0].tolist() == [102, 102, 102, 8, 9]
    assert model.encoded == 1 and state.image_embeds == {}


def test_tensor_data_round_trips_and_a_wrong_size_is_an_error():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    data = TensorData(data=array.tobytes(), dtype="float32", shape=[2, 3])
    assert torch.equal(tensor_from_data(data), torch.from_numpy(array))
    with pytest.raises(ValueError, match="needs 12"):
        tensor_from_data(TensorData(data=array.tobytes(), dtype="float32", shape=[3, 4]))
