import pytest

from vllm_omni.core.block_manager import BlockManager
from vllm_omni.core.request import Request, RequestStatus
from vllm_omni.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], **kwargs) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), **kwargs)


def compute(bm: BlockManager, req: Request, n: int) -> None:
    """What one engine step does for the block manager: allocate, compute, register."""
    cached = bm.find_cached_prefix(req) if not req.block_ids else []
    if cached:
        req.num_computed_tokens = len(cached) * bm.block_size
    assert bm.allocate(req, n, cached)
    req.num_computed_tokens += n
    bm.cache_full_blocks(req)


def assert_pool_clean(bm: BlockManager) -> None:
    assert all(rc == 0 for rc in bm.ref_counts)
    assert bm.num_free_blocks == bm.num_blocks


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    req = make_request("a", list(range(10)))
    compute(bm, req, 10)
    assert len(req.block_ids) == 3 and bm.num_free_blocks == 5
    for _ in range(3):  # decode crosses into a 4th block
        req.append_output_token(7)
        compute(bm, req, 1)
    assert len(req.block_ids) == 4
    bm.free(req)
    assert req.block_ids == []
    assert_pool_clean(bm)


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=True)
    req = make_request("a", list(range(12)))
    assert not bm.allocate(req, 12)
    assert req.block_ids == [] and bm.num_free_blocks == 2


def test_prefix_hit_shares_blocks_and_ref_counts():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prefix = list(range(100, 112))  # 3 full blocks
    a = make_request("a", prefix + [1, 2])
    compute(bm, a, a.num_tokens)
    b = make_request("b", prefix + [3, 4, 5])
    cached = bm.find_cached_prefix(b)
    assert cached == a.block_ids[:3]
    compute(bm, b, b.num_tokens - 12)
    assert b.block_ids[:3] == a.block_ids[:3]
    assert all(bm.ref_counts[blk] == 2 for blk in a.block_ids[:3])
    bm.free(a)
    assert all(bm.ref_counts[blk] == 1 for blk in b.block_ids[:3])
    bm.free(b)
    assert_pool_clean(bm)


def test_hit_leaves_at_least_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(8)))
    compute(bm, a, 8)
    b = make_request("b", list(range(8)))  # identical prompt: only the first block may hit
    assert len(bm.find_cached_prefix(b)) == 1


def test_freed_blocks_stay_findable_until_reused():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    compute(bm, a, 9)
    bm.free(a)
    assert_pool_clean(bm)
    b = make_request("b", list(range(9)))
    assert len(bm.find_cached_prefix(b)) == 2
    # Fill the whole pool with other content: the old blocks are evicted.
    c = make_request("c", list(range(50, 66)))
    compute(bm, c, 16)
    bm.free(c)
    assert bm.find_cached_prefix(make_request("d", list(range(9)))) == []


def test_hash_chain_distinguishes_equal_blocks_after_different_prefixes():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_request("a", [1, 1, 1, 1, 9, 9, 9, 9, 0])
    compute(bm, a, a.num_tokens)
    b = make_request("b", [2, 2, 2, 2, 9, 9, 9, 9, 0])
    assert bm.find_cached_prefix(b) == []


@pytest.mark.parametrize("kwargs", [{"return_hidden_states": True}])
def test_requests_that_export_hidden_states_skip_the_cache(kwargs):
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = make_request("a", list(range(9)))
    compute(bm, a, 9)
    assert bm.find_cached_prefix(make_request("b", list(range(9)), **kwargs)) == []


def test_request_status_finished_flags():
    assert not RequestStatus.RUNNING.finished
    assert RequestStatus.FINISHED_ABORTED.finished
