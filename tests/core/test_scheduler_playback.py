"""A talker's scheduler in playback-deadline order (SchedulerConfig.audio_seconds_per_token):
the request preempted first is the one with the most audio ahead of its listener, and a waiting
request is admitted earliest deadline first. Tokens are appended by hand as the engine would."""
from vllm_omni.core.block_manager import BlockManager
from vllm_omni.core.request import Request, RequestStatus
from vllm_omni.core.scheduler import Scheduler, SchedulerConfig
from vllm_omni.sampling_params import SamplingParams


class FakeClock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler(seconds_per_token, clock, num_blocks=7, max_num_seqs=4):
    config = SchedulerConfig(max_num_seqs, 64, 1024, audio_seconds_per_token=seconds_per_token,
                             first_audio_target_s=0.1)
    return Scheduler(config, BlockManager(num_blocks, 4, False), clock=clock)


def step(sched):
    out = sched.schedule()
    sched.advance(out)
    for item in out.scheduled:
        if item.request.num_computed_tokens == item.request.num_tokens:
            item.request.append_output_token(7)
    return out


def old_and_young(seconds_per_token):
    """"old" arrives at t=0 and makes 16 tokens (1.28 s of audio at 80 ms a token), "young"
    arrives at t=1.0; both then grow until the 7-block pool runs dry."""
    clock = FakeClock()
    sched = scheduler(seconds_per_token, clock)
    old = Request("old", [1, 2, 3, 4], SamplingParams())
    sched.add_request(old)
    for _ in range(17):
        step(sched)
    clock.now = 1.0
    young = Request("young", [5, 6, 7, 8], SamplingParams())
    sched.add_request(young)
    for _ in range(12):
        out = step(sched)
        if out.preempted:
            return sched, clock, out.preempted
    raise AssertionError("the pool never ran dry")


def test_the_stream_with_the_most_audio_ahead_is_preempted_first():
    # Playback order: old's listener has sound until 0 + 0.1 + 20 x 0.08 = 1.7 s, young's until
    # 1.0 + 0.1 + 2 x 0.08 = 1.26 s: old can wait for its recompute, young cannot.
    _, _, preempted = old_and_young(0.08)
    assert [r.request_id for r in preempted] == ["old"]
    # Arrival order (not an audio stream): the newest request is the victim, as before.
    _, _, preempted = old_and_young(None)
    assert [r.request_id for r in preempted] == ["young"]


def test_waiting_requests_are_admitted_earliest_deadline_first():
    """The preempted old stream (due at 1.7 s) waits behind a request arriving at 1.2 s (due at
    its first-audio target, 1.3 s); in arrival order a preempted request goes back first."""
    sched, clock, _ = old_and_young(0.08)
    clock.now = 1.2
    fresh = Request("fresh", [9, 10, 11], SamplingParams())
    sched.add_request(fresh)
    young = sched.requests["young"]
    sched.finish(young, RequestStatus.FINISHED_LENGTH)  # room for one of the two waiting
    out = step(sched)
    assert [i.request.request_id for i in out.scheduled][0] == "fresh"
