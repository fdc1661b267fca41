"""Scheduling by playback deadline (vllm_omni/playback.py, worker/playback_deadlines.py).

Units on a fake clock, then a timeline: a code2wav-like stage (the real GenerationStageEngine,
a toy decoder whose calls cost fake time) with streams playing and a burst of new arrivals.
docs/streaming.md ("Scheduling by playback deadline") walks through the same timeline.
"""
from __future__ import annotations

import logging

from dataclasses import dataclass, field

import pytest
import torch

from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler
from vllm_omni.engine.playback_admission import AdmissionOptions, PlaybackAdmission
from vllm_omni.entrypoints.cli.bench.metrics import playback
from vllm_omni.model_executor.models.generation_model import GenerationModel
from vllm_omni.playback import PlaybackTimeline, token_deadline
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.stage_io import StageInputChunk, StageRequest
from vllm_omni.worker.decode_lanes import HostLanes
from vllm_omni.worker.generation_stage_engine import GenerationStageEngine
from vllm_omni.worker.playback_deadlines import StreamDeadlines


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_timeline_is_due_when_its_listener_runs_dry():
    t = PlaybackTimeline(waiting_since=1.0, first_audio_target_s=0.1)
    assert t.deadline == pytest.approx(1.1) and not t.playing  # a new stream: its first-audio target
    t.emitted(1.05, 0.0)  # a chunk without audio starts nothing: it waits again from then
    assert t.deadline == pytest.approx(1.15) and not t.playing
    t.emitted(1.2, 0.08)
    t.emitted(1.25, 0.16)
    assert t.playing and t.deadline == pytest.approx(1.2 + 0.24)
    assert t.buffered(1.3) == pytest.approx(0.14) and t.buffered(1.5) == pytest.approx(-0.06)


def test_a_talker_request_is_due_by_the_audio_of_its_tokens():
    assert token_deadline(2.0, 0, 0.08, 0.1) == pytest.approx(2.1)  # no token: its first chunk's deadline
    assert token_deadline(2.0, 25, 0.08, 0.1) == pytest.approx(4.1)


def _deadlines(clock, streams):
    """StreamDeadlines with streams opened at given times and given audio emitted: {rid: (open, [(t, s)])}."""
    d = StreamDeadlines(0.1, clock)
    for rid, (opened, chunks) in streams.items():
        clock.now = opened
        d.open(rid)
        for t, seconds in chunks:
            clock.now = t
            d.record(rid, {"audio": torch.zeros(int(seconds * 100)), "sample_rate": torch.tensor(100)})
    return d


def test_by_margin_a_first_chunk_waits_only_for_a_stream_due_sooner_and_close_to_running_dry(monkeypatch):
    """`VLLM_OMNI_FIRST_CHUNK_HOLD=margin` (an A/B candidate against the default, `deadline`)."""
    monkeypatch.setenv("VLLM_OMNI_FIRST_CHUNK_HOLD", "margin")
    clock = FakeClock()
    # low: played from 0.0, 0.5 s emitted -> dry at 0.5; rich: dry at 2.0; new: arrived 0.45 -> due 0.55
    d = _deadlines(clock, {"low": (0.0, [(0.0, 0.5)]), "rich": (0.0, [(0.0, 2.0)]), "new": (0.45, [])})
    clock.now = 0.46  # low has 40 ms of sound left
    # The calls measured so far: 10 ms for first chunks; 50 ms, then 25 ms from a launch to its
    # collection (the estimate keeps the longer one, decayed) -> the stream due first holds first
    # chunks with less than 20 + 10 + 47.5 ms left, the one behind a call of others 47.5 ms more.
    for kind, seconds in (("first", 0.01), ("later", 0.05), ("later", 0.025)):
        d.timed_call(kind, seconds)
    assert d.margin_s(0) == pytest.approx(0.02 + 0.01 + 0.05 * 0.95)
    assert d.margin_s(1) == pytest.approx(0.02 + 0.01 + 2 * 0.05 * 0.95)
    # low (dry at 0.5) is due before new (0.55) and within the margin: its chunk goes first, new's
    # first chunk waits.
    for overlapping in (True, False):
        plan = d.plan(["rich", "new", "low"], {"new"}, [], can_launch=True, overlapping=overlapping)
        assert plan.first == [] and plan.later == ["low", "rich"]
    # Overlapping lanes with low's chunk already on the GPU: new's first chunk would run ahead of it.
    held = d.plan(["rich", "new"], {"new"}, ["low"], can_launch=False, overlapping=True)
    assert held.first == [] and held.later == []
    # Without low, new is due first: its first chunk goes at once, rich's chunk is launched beside it
    # on overlapping lanes, and waits for the next step on serial ones.
    free = d.plan(["rich", "new"], {"new"}, [], can_launch=True, overlapping=True)
    assert free.first == ["new"] and free.later == ["rich"]
    serial = d.plan(["rich", "new"], {"new"}, [], can_launch=True, overlapping=False)
    assert serial.first == ["new"] and serial.later == []
    # Calls as short as the floor's: low, still due before new, has 40 ms left, more than the 20 ms
    # that a first call and its own call need: new's first chunk goes beside it.
    quick = _deadlines(clock, {"low": (0.0, [(0.0, 0.5)]), "new": (0.45, [])})
    clock.now = 0.46
    assert quick.margin_s(0) == pytest.approx(0.02)
    plan = quick.plan(["new", "low"], {"new"}, [], can_launch=True, overlapping=True)
    assert plan.first == ["new"] and plan.later == ["low"]
    # The default rule: any playing stream due sooner holds it.
    monkeypatch.setenv("VLLM_OMNI_FIRST_CHUNK_HOLD", "deadline")
    before = _deadlines(clock, {"low": (0.0, [(0.0, 0.5)]), "new": (0.45, [])})
    clock.now = 0.46
    assert before.plan(["new", "low"], {"new"}, [], can_launch=True, overlapping=True).first == []


# --- the timeline --------------------------------------------------------------------------------

FRAME_S = 0.08  # audio per frame (a 12.5 Hz codec)
RATE = 100  # samples per second of the toy audio
RAMP = (1, 1, 2, 4, 8)  # frames per chunk, then the last size again (the real ramp's shape)


class RampStream:
    """A stream of frames decoded in chunks of RAMP frames (a smaller last chunk at the end)."""

    def __init__(self) -> None:
        self.pending = self.consumed = self.chunks = 0
        self.final = False

    def push(self, units, final):
        self.pending += units.shape[0]
        self.final = final

    def next_size(self) -> int:
        return RAMP[min(self.chunks, len(RAMP) - 1)]

    def ready(self) -> bool:
        return self.pending >= self.next_size() or (self.final and self.pending > 0)

    @property
    def finished(self) -> bool:
        return self.final and self.pending == 0


class CostlyDecoder(GenerationModel):
    """Every call costs fake time: a fixed part and a part per stream (a GPU-bound decoder)."""

    accepts_streamed_input = True
    max_units_per_chunk = RAMP[-1]

    def __init__(self, clock: FakeClock, fixed_s: float, per_stream_s: float) -> None:
        self.clock, self.fixed_s, self.per_stream_s = clock, fixed_s, per_stream_s

    @classmethod
    def load(cls, model_path, **kw):
        raise AssertionError("built by the test")

    def generate_batch(self, inputs):
        raise AssertionError("streams only")

    def open_stream(self, req):
        return RampStream()

    def decode_streams(self, streams):
        self.clock.now += self.fixed_s + self.per_stream_s * len(streams)
        out = []
        for s in streams:
            n = min(s.next_size(), s.pending)
            s.pending, s.consumed, s.chunks = s.pending - n, s.consumed + n, s.chunks + 1
            out.append({"audio": torch.zeros(round(n * FRAME_S * RATE)), **({"sample_rate": torch.tensor(RATE)}
                                                                          if s.chunks == 1 else {})})
        return out


@dataclass
class Stream:
    rid: str
    arrival: float
    frames: int
    admitted_at: float | None = None
    made: int = 0  # frames its talker has made
    sent: int = 0  # frames handed to the stage
    chunks: list[tuple[float, float]] = field(default_factory=list)  # (emitted at, seconds)

    @property
    def done(self) -> bool:
        return sum(c[1] for c in self.chunks) >= self.frames * FRAME_S - 1e-9


@dataclass
class Timeline:
    streams: dict[str, Stream]
    admission: PlaybackAdmission

    def underruns(self, prefix: str) -> int:
        return sum(playback(s.chunks).underruns for rid, s in self.streams.items() if rid.startswith(prefix))

    def first_audio(self, prefix: str) -> list[float]:
        return [s.chunks[0][0] - s.arrival for rid, s in self.streams.items() if rid.startswith(prefix)]


def run_timeline(*, deadlines: bool, admission: str, playing=20, burst=40, burst_at=2.0, burst_span=0.0, frames=60,
                 talker_step=(0.005, 0.001), decode_cost=(0.005, 0.002), max_batch=8, headroom=0.2,
                 window_s=1.0) -> Timeline:
    """`playing` streams arriving over the first second, `burst` more at `burst_at`, each of
    `frames` frames. The talker (its own device) steps every a + b x n seconds for its n active
    streams, a frame for each; the stage's decode calls cost c + d x streams. `deadlines`: the
    stage orders by playback deadline (else first chunks always first, the policy before);
    `admission`: the orchestrator's policy ("queue" or "off")."""
    clock = FakeClock()
    target = 0.1 if deadlines else float("-inf")  # -inf: every new stream is due before any playing one
    engine = GenerationStageEngine(CostlyDecoder(clock, *decode_cost), OmniGenerationScheduler(max_batch),
                                   stage_id=1, lanes=HostLanes(), deadlines=StreamDeadlines(target, clock))
    timers: list[tuple[float, object]] = []
    streams = {f"p{i}": Stream(f"p{i}", i / playing, frames) for i in range(playing)}
    streams.update({f"n{i}": Stream(f"n{i}", burst_at + burst_span * i / burst, frames) for i in range(burst)})

    def start(s: Stream) -> str:
        s.admitted_at = clock.now
        return s.rid

    gate = PlaybackAdmission(AdmissionOptions(admission, headroom=headroom, window_s=window_s), start,
                             lambda s, why: pytest.fail(f"{s.rid} refused: {why}"),
                             lambda delay, fn: timers.append((clock.now + delay, fn)), clock)
    arrived, next_talker_step = set(), 0.0
    while not all(s.done for s in streams.values()):
        assert clock.now < 60, "the timeline did not finish"
        for s in streams.values():
            if s.rid not in arrived and clock.now >= s.arrival:
                arrived.add(s.rid)
                gate.submit(s, s.rid, audio=True)
        for due, fn in [t for t in timers if t[0] <= clock.now]:
            timers.remove((due, fn))
            fn()
        talking = [s for s in streams.values() if s.admitted_at is not None and s.made < s.frames]
        if talking and clock.now >= next_talker_step:
            for s in talking:
                s.made += 1
            next_talker_step = clock.now + talker_step[0] + talker_step[1] * len(talking)
        for s in talking:
            if s.made > s.sent:
                if s.sent == 0:
                    engine.add_request(StageRequest(request_id=s.rid, prompt_token_ids=[], input_complete=False,
                                                    sampling_params=SamplingParams()))
                engine.add_input(StageInputChunk(request_id=s.rid, final=s.made == s.frames,
                                                 additional_information={"units": torch.zeros(s.made - s.sent)}))
                s.sent = s.made
        if engine.has_work():
            for out in engine.step():
                assert out.error is None
                s = streams[out.request_id]
                audio = out.multimodal_output.get("audio")
                if audio is not None and audio.numel():
                    s.chunks.append((clock.now, audio.numel() / RATE))
                    gate.chunk(s.rid, audio.numel() / RATE)
                if out.finished:
                    gate.finished(s.rid)
        else:
            clock.now += 0.001
    return Timeline(streams, gate)


BURST = dict(playing=10, burst=80, burst_at=1.5, burst_span=1.0, frames=100, talker_step=(0.008, 0.0003),
             decode_cost=(0.006, 0.002), max_batch=8)


def test_under_a_burst_no_playing_stream_runs_dry_while_new_starts_wait():
    """Ten streams playing, then 80 new requests within a second (docs/streaming.md's timeline):
    the stage's calls take 6 ms + 2 ms a stream, 8 streams a call; each stream's chunks ramp up
    (1, 1, 2, 4, then 8 frames), so a stream that has just started has 80 ms of sound, then
    160 ms, ... When first chunks always go first (the policy before deadlines), each new start
    takes a call from streams in their ramp, which run dry. By deadline, a first chunk waits
    while a started stream has less sound left than the new one's first-audio target: first audio
    comes later, within the target, and not one stream runs dry."""
    before = run_timeline(deadlines=False, admission="off", **BURST)
    after = run_timeline(deadlines=True, admission="queue", **BURST)
    assert before.underruns("n") > 0 and after.underruns("n") == 0
    assert before.underruns("p") == after.underruns("p") == 0
    assert max(after.first_audio("n")) > max(before.first_audio("n"))  # new starts wait ...
    assert max(after.first_audio("n")) <= 0.1  # ... within their first-audio target


def test_admission_holds_new_streams_past_the_playback_load_and_lets_them_in_as_it_drops(caplog):
    caplog.set_level(logging.WARNING, logger="vllm_omni.engine.playback_admission")
    clock = FakeClock()
    started, refused, timers = [], [], []
    gate = PlaybackAdmission(AdmissionOptions("queue", headroom=0.2, max_wait_s=5.0, window_s=10.0),
                             lambda rid: started.append(rid) or rid, lambda rid, why: refused.append((rid, why)),
                             lambda delay, fn: timers.append((clock.now + delay, fn)), clock)
    gate.submit("text", "text", audio=False)  # no audio: never held
    for rid in ("a", "b"):
        gate.submit(rid, rid, audio=True)  # nothing measured yet: admitted
    assert started == ["text", "a", "b"]
    for step in range(1, 6):  # each stream: 0.1 s of audio every 0.06 s -> rtf 0.6
        clock.now = 0.06 * step
        gate.chunk("a", 0.1)
        gate.chunk("b", 0.1)
    assert gate.load.measured() == (pytest.approx(0.6), 2)
    assert gate.load.with_one_more() == pytest.approx(0.9)  # 0.6 x (2 + 1) / 2 > 0.8: c waits
    gate.submit("c", "c", audio=True)
    assert started == ["text", "a", "b"] and gate.queued == 1 and gate.counters["queued"] == 1
    held = [r.getMessage() for r in caplog.records]  # why requests wait, for the operator
    assert len(held) == 1 and "1 requests queued" in held[0] and "rtf 0.600 over 2 streams" in held[0]
    gate.finished("a")  # one stream less: 0.6 x (1 + 1) / 2 = 0.6 fits
    assert started[-1] == "c" and gate.queued == 0
    gate.submit("d", "d", audio=True)  # 0.6 x 3 / 2 again: waits, and its wait runs out
    for due, fn in sorted(timers, key=lambda t: t[0]):  # the event loop's timers until t = 6, on the fake clock
        if due > 6.0:
            break
        clock.now = max(clock.now, due)
        fn()
    assert [rid for rid, _ in refused] == ["d"] and "no room within 5 s" in refused[0][1]
    assert len(caplog.records) == 1  # d was held within 5 s of c: logged at most every 5 s
    reject = PlaybackAdmission(AdmissionOptions("reject"), lambda rid: rid, lambda rid, why: refused.append((rid, why)),
                               lambda delay, fn: None, clock)
    reject.load = gate.load
    gate.load.admitted("e")  # three streams now: with one more 0.6 x 4 / 2
    reject.submit("f", "f", audio=True)
    assert refused[-1][0] == "f" and "playback load" in refused[-1][1] and reject.counters["refused"] == 1


@pytest.fixture(scope="module")
def tts_code2wav(tiny_model):
    """The real Qwen3-TTS code2wav of the tiny checkpoint, with the bundled chunks (1 frame first)."""
    from vllm_omni.model_executor.models.code2wav_stream import Code2WavStreamConfig
    from vllm_omni.model_executor.models.qwen3_tts.code2wav import Qwen3TTSCode2Wav

    return Qwen3TTSCode2Wav.load(str(tiny_model("qwen3_tts")), device="cpu", stream_config=Code2WavStreamConfig(
        initial_chunk_frames=1, chunk_frames=25, left_context_frames=25))


def test_tiny_tts_code2wav_decodes_a_stream_running_dry_before_a_new_first_chunk(tts_code2wav):
    """The real Qwen3-TTS code2wav (tiny checkpoint) in its stage engine: "low" has played most
    of its first chunk when its next frame and a new stream's first frame are both ready. Low is
    due first (before, first chunks always went first): its chunk is decoded first, the new
    stream's first chunk in the next step."""
    model = tts_code2wav
    clock = FakeClock()
    engine = GenerationStageEngine(model, OmniGenerationScheduler(8), stage_id=1, lanes=HostLanes(),
                                   deadlines=StreamDeadlines(0.1, clock))
    frames = torch.randint(0, model.decoder.codebook_size, (2, model.decoder.num_quantizers))

    def send(rid, frame, opens=False):
        if opens:
            engine.add_request(StageRequest(request_id=rid, prompt_token_ids=[], input_complete=False,
                                            sampling_params=SamplingParams()))
        engine.add_input(StageInputChunk(request_id=rid, additional_information={"units": frame[None]}, final=False))

    send("low", frames[0], opens=True)
    (first,) = engine.step()
    chunk_s = first.multimodal_output["audio"].numel() / int(first.multimodal_output["sample_rate"])
    assert first.request_id == "low" and chunk_s > 0
    clock.now = 0.9 * chunk_s  # low has a tenth of its first chunk left
    send("low", frames[1])
    send("new", frames[0], opens=True)
    assert [out.request_id for _ in range(2) for out in engine.step()] == ["low", "new"]


def test_a_first_chunk_due_after_a_launched_chunk_waits_for_it_without_spinning():
    """Overlapping lanes: a and b's second chunks are on the device when a new stream comes whose
    first-audio target lies past their deadlines. Its first chunk waits (no step output, no work:
    the worker polls) until the launch is collected, then goes."""
    from tests.pipeline.test_stage_units import HeldLanes, OneUnitChunks, _open

    clock = FakeClock()
    lanes = HeldLanes()
    engine = GenerationStageEngine(OneUnitChunks(), OmniGenerationScheduler(8), stage_id=2, lanes=lanes,
                                   deadlines=StreamDeadlines(0.1, clock))
    _open(engine, "a", 3)
    _open(engine, "b", 3)
    assert sorted(o.request_id for o in engine.step()) == ["a", "b"]  # first chunks: 1 s of sound each
    assert engine.step() == [] and len(lanes.launched) == 1  # their second chunks, on the device
    clock.now = 0.95  # a and b have 50 ms left; a new stream is due 100 ms after it comes
    _open(engine, "new", 2)
    assert engine.step() == [] and not engine.has_work() and engine.poll_ms() == 1
    lanes.launched[0].released = True
    assert engine.has_work()
    assert sorted(o.request_id for o in engine.step()) == ["a", "b", "new"]  # collected, then new's first chunk
