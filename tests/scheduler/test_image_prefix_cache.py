"""The prefix cache keys image placeholders by the image's content: the same placeholder ids
with another image share no blocks, the same image hits."""
import pytest

from common.errors import InvalidRequestError
from common.protocol import ImageInput, TensorData
from scheduler.prefix_hash import image_extra_keys
from tests.scheduler.fake_worker import make_request, make_scheduler

IMAGE_TOKEN = 99
PROMPT = [10, 11] + [IMAGE_TOKEN] * 6 + [12, 13, 14, 15, 16]  # 13 tokens: 3 full blocks of 4


def image_request(request_id: str, content_hash: str, offset: int = 2, length: int = 6):
    request = make_request(request_id, PROMPT, max_tokens=1)
    request.images = [ImageInput(offset=offset, length=length, content_hash=content_hash,
                                 pixel_values=TensorData(data=b"\0" * 4, dtype="float32", shape=[1]))]
    return request


def run_one(scheduler, worker, request):
    scheduler.add_request(request)
    plan = scheduler.schedule()
    [new] = plan.new_requests
    assert new.images == request.images  # the worker gets the pixels with the request
    [out] = scheduler.update(plan, worker.execute(plan))
    return new, out


def test_another_image_shares_no_blocks_and_the_same_image_hits():
    scheduler, worker = make_scheduler(num_blocks=20)
    first, _ = run_one(scheduler, worker, image_request("a", "hash-a"))
    other, out = run_one(scheduler, worker, image_request("b", "hash-b"))
    assert other.num_computed_tokens == 0 and out.num_cached_tokens == 0
    assert not set(other.block_ids[:3]) & set(first.block_ids[:3])
    again, out = run_one(scheduler, worker, image_request("c", "hash-a"))
    assert again.num_computed_tokens == 12 and out.num_cached_tokens == 12
    assert again.block_ids[:3] == first.block_ids[:3]


def test_text_before_the_image_still_hits_across_images():
    scheduler, worker = make_scheduler(num_blocks=20)
    # The image starts in block 1: block 0 (tokens 0-3) is plain text, shared by both.
    first, _ = run_one(scheduler, worker, image_request("a", "hash-a", offset=4, length=4))
    other, _ = run_one(scheduler, worker, image_request("b", "hash-b", offset=4, length=4))
    assert other.num_computed_tokens == 4 and other.block_ids[0] == first.block_ids[0]
    assert other.block_ids[1] != first.block_ids[1]


def test_image_extra_keys_name_the_images_a_block_overlaps():
    images = [(2, 6, "x"), (8, 2, "y")]
    assert image_extra_keys(0, 4, images) == ("x",)
    assert image_extra_keys(4, 8, images) == ("x",)
    assert image_extra_keys(8, 12, images) == ("y",)
    assert image_extra_keys(12, 16, images) == ()


@pytest.mark.parametrize("offset, length", [(10, 6), (-1, 3), (2, 0)])
def test_placeholders_outside_the_prompt_are_refused(offset, length):
    scheduler, _ = make_scheduler(num_blocks=20)
    with pytest.raises(InvalidRequestError, match="placeholder tokens"):
        scheduler.add_request(image_request("a", "h", offset=offset, length=length))
