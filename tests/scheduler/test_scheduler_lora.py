"""Multi-LoRA in the scheduler: prefix-cache blocks are keyed by adapter, a step never holds
more than max_loras adapters, and adapter requests need enable_lora."""
import pytest

from common.errors import InvalidRequestError
from common.lora_request import LoRARequest
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request
from tests.scheduler.fake_worker import make_request, make_scheduler

BLOCK_SIZE = 4
PROMPT = list(range(10, 23))  # three full blocks and one token
A, B = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")


def lora_request(request_id: str, lora: LoRARequest | None, prompt=PROMPT, **kwargs):
    engine_request = make_request(request_id, prompt, **kwargs)
    engine_request.lora_request = lora
    return engine_request


def admitted_hits(manager: KVCacheManager, request_id: str, lora: LoRARequest | None) -> int:
    request = Request(lora_request(request_id, lora), arrival_order=0, max_model_len=64, block_size=BLOCK_SIZE,
                      enable_caching=True)
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)
    return num_hit


def test_prefix_cache_blocks_are_keyed_by_adapter():
    manager = KVCacheManager(num_blocks=30, block_size=BLOCK_SIZE)
    assert admitted_hits(manager, "a1", A) == 0
    assert admitted_hits(manager, "b1", B) == 0  # the same prompt under another adapter: no sharing
    assert admitted_hits(manager, "base1", None) == 0  # nor with the base model
    assert admitted_hits(manager, "a2", A) == 12  # the same adapter shares the full blocks
    assert admitted_hits(manager, "b2", B) == 12
    assert admitted_hits(manager, "base2", None) == 12


def test_a_step_holds_at_most_max_loras_adapters():
    scheduler, _ = make_scheduler(num_blocks=40, enable_lora=True, max_loras=1)
    for request_id, lora in (("a", A), ("base", None), ("b", B), ("a2", A)):
        scheduler.add_request(lora_request(request_id, lora, prompt=[5, 6, 7], max_tokens=4))
    plan = scheduler.schedule()
    # "b" waits (one adapter slot, held by "a"); no overtaking: "a2" waits behind it.
    assert list(plan.num_scheduled_tokens) == ["a", "base"]
    assert {new.request_id: new.lora_request for new in plan.new_requests} == {"a": A, "base": None}


def test_adapter_requests_need_enable_lora():
    scheduler, _ = make_scheduler()
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        scheduler.add_request(lora_request("x", A))


def test_a_reloaded_name_is_another_adapter():
    """Unloaded and loaded again (a new id), from the same path or another: no shared KV with the old
    version, and its requests wait while the old version's run (the worker holds one per name)."""
    manager = KVCacheManager(num_blocks=30, block_size=BLOCK_SIZE)
    assert admitted_hits(manager, "a1", A) == 0
    assert admitted_hits(manager, "a-again", LoRARequest("a", 3, "/a")) == 0
    assert admitted_hits(manager, "a-elsewhere", LoRARequest("a", 4, "/elsewhere")) == 0
    assert admitted_hits(manager, "a2", A) == 12

    scheduler, _ = make_scheduler(num_blocks=40, enable_lora=True, max_loras=2)
    for request_id, lora in (("old", A), ("new", LoRARequest("a", 3, "/a")), ("base", None)):
        scheduler.add_request(lora_request(request_id, lora, prompt=[5, 6, 7], max_tokens=4))
    assert list(scheduler.schedule().num_scheduled_tokens) == ["old"]  # no overtaking: "base" waits too
    scheduler.abort_requests(["old"])
    assert list(scheduler.schedule().num_scheduled_tokens) == ["new", "base"]
