"""Scheduler unit tests: no model, tokens are appended by hand as the engine would."""
import random

from vllm_omni.core.block_manager import BlockManager
from vllm_omni.core.request import Request, RequestStatus
from vllm_omni.core.scheduler import Scheduler, SchedulerConfig
from vllm_omni.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=64, caching=True):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens_per_step, 1024), bm)


def run_step(sched: Scheduler, max_new: dict[str, int]):
    out = sched.schedule()
    sched.advance(out)
    for item in out.scheduled:
        req = item.request
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(random.randrange(50))
            if req.num_output_tokens >= max_new[req.request_id]:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
    return out


def drain(sched, max_new, limit=1000):
    steps = []
    for _ in range(limit):
        if not sched.has_unfinished():
            return steps
        steps.append(run_step(sched, max_new))
    raise AssertionError("scheduler did not finish")


def test_budget_and_max_num_seqs_are_respected():
    sched = make_scheduler(max_num_seqs=3, max_tokens_per_step=10)
    max_new = {}
    for i in range(6):
        sched.add_request(Request(str(i), list(range(7 + i)), SamplingParams()))
        max_new[str(i)] = 5
    for out in drain(sched, max_new):
        assert out.num_tokens <= 10
        assert len(out.scheduled) <= 3
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_chunked_prefill_splits_long_prompt():
    sched = make_scheduler(max_tokens_per_step=8)
    sched.add_request(Request("a", list(range(20)), SamplingParams()))
    sizes = [sum(s.num_new_tokens for s in run_step(sched, {"a": 3}).scheduled) for _ in range(3)]
    assert sizes == [8, 8, 4]


def test_fcfs_order_of_admission():
    sched = make_scheduler(max_num_seqs=1)
    for rid in "abc":
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams()))
    order = []
    for out in drain(sched, {"a": 2, "b": 2, "c": 2}):
        for s in out.scheduled:
            if not order or order[-1] != s.request.request_id:
                order.append(s.request.request_id)
    assert order == ["a", "b", "c"]


def test_preemption_recomputes_latest_request_and_frees_everything():
    random.seed(0)
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, max_tokens_per_step=64, caching=False)
    max_new = {}
    for i in range(3):
        sched.add_request(Request(str(i), list(range(6)), SamplingParams()))
        max_new[str(i)] = 10
    steps = drain(sched, max_new)
    preempted = [r.request_id for out in steps for r in out.preempted]
    assert preempted, "a 6-block pool cannot hold three 16-token sequences"
    assert "0" not in preempted  # the oldest request is never the victim while others run
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(rc == 0 for rc in bm.ref_counts)


def test_abort_waiting_and_running_requests_frees_blocks():
    sched = make_scheduler(max_num_seqs=1)
    a = Request("a", list(range(9)), SamplingParams())
    b = Request("b", list(range(9)), SamplingParams())
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched, {"a": 100, "b": 100})
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished()
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(rc == 0 for rc in bm.ref_counts)


def test_prefix_cache_hit_counts_cached_tokens():
    sched = make_scheduler(block_size=4)
    sched.add_request(Request("a", list(range(13)), SamplingParams()))
    drain(sched, {"a": 1})
    b = Request("b", list(range(13)) + [99], SamplingParams())
    sched.add_request(b)
    out = run_step(sched, {"b": 1})
    assert b.num_cached_tokens == 12
    assert out.scheduled[0].num_new_tokens == 2


def test_a_request_waiting_for_streamed_input_leaves_the_batch_and_comes_back():
    """Input that streams in: compute what is there, then wait out of the batch (slot freed,
    blocks kept, no work), and come back first when more arrives."""
    sched = make_scheduler(max_num_seqs=1, max_tokens_per_step=16)
    streamed = Request("s", list(range(6)), SamplingParams(), input_complete=False)
    streamed.input_limit = 4  # inputs of positions 0..3 are there
    sched.add_request(streamed)
    sched.add_request(Request("other", [1, 2, 3], SamplingParams()))
    out = run_step(sched, {"s": 3, "other": 2})
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("s", 4)]
    # Caught up with its input: it waits without its batch slot, which "other" takes at once.
    out = run_step(sched, {"s": 3, "other": 2})
    assert [i.request.request_id for i in out.scheduled] == ["other"]
    assert streamed.status is RequestStatus.WAITING_FOR_INPUT and streamed.block_ids
    run_step(sched, {"s": 3, "other": 2})
    assert not sched.has_work() and sched.has_unfinished()  # nothing to do: the worker blocks
    streamed.input_limit = None  # the rest arrived (the engine sets the limit, then wakes it)
    sched.wake(streamed)
    assert sched.has_work()
    out = run_step(sched, {"s": 3, "other": 2})
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("s", 2)]
    drain(sched, {"s": 3, "other": 2})
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_paused_and_waiting_requests_are_preempted_first():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, max_tokens_per_step=64)
    idle = Request("idle", list(range(8)), SamplingParams())
    sched.add_request(idle)
    run_step(sched, {"idle": 10})
    idle.paused = True  # flow control: its consumer is behind
    busy = Request("busy", list(range(100, 112)), SamplingParams())  # shares no cached prefix
    sched.add_request(busy)
    out = run_step(sched, {"idle": 10, "busy": 10})
    assert [i.request.request_id for i in out.scheduled] == ["busy"] and idle.status is RequestStatus.WAITING_FOR_INPUT
    for _ in range(6):  # busy grows until the pool runs dry: the parked request gives way, not busy
        out = run_step(sched, {"idle": 10, "busy": 10})
        if out.preempted:
            break
    assert [r.request_id for r in out.preempted] == ["idle"] and idle.status is RequestStatus.WAITING
    idle.paused = False
    drain(sched, {"idle": 10, "busy": 10})
