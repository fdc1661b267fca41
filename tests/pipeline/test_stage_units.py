"""In-process units of the runtime: bridges, the generation scheduler and engine, params."""
from __future__ import annotations

import pytest
import torch

from vllm_omni.config.stage_config import StageConfig, StageEngineArgs, StageRuntimeConfig
from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler
from vllm_omni.model_executor.models.generation_model import GenerationModel
from vllm_omni.stage_io import StageInputChunk, StageRequest
from vllm_omni.worker.decode_lanes import HostLanes, Launched
from vllm_omni.worker.generation_stage_engine import GenerationStageEngine
from vllm_omni.engine.stage_input import StageView, build_stage_input, default_input_processor
from vllm_omni.inputs import OmniTokensPrompt
from vllm_omni.outputs import CompletionOutput, RequestOutput
from vllm_omni.sampling_params import SamplingParams


def request_output(request_id, prompt_ids, token_ids):
    return RequestOutput(request_id, None, prompt_ids, [CompletionOutput(0, "", token_ids, finish_reason="stop")], True)


def stage(stage_id=1, sources=(0,)):
    return StageConfig(stage_id=stage_id, runtime=StageRuntimeConfig(), engine_args=StageEngineArgs(),
                       default_sampling_params=SamplingParams(), engine_input_source=sources)


def test_default_bridge_passes_the_source_output_tokens():
    out = request_output("r", [1, 2], [7, 8, 9])
    inp = build_stage_input(default_input_processor, "default", stage(), 2, {0: out}, {"prompt": "x"}, "r")
    assert inp["prompt_token_ids"] == [7, 8, 9] and inp["additional_information"] == {}


def test_bridges_see_only_their_request():
    seen = []

    def bridge(stage_list, engine_input_source, prompt, requires_multimodal_data):
        seen.append([o.request_id for o in stage_list[0].engine_outputs])
        return [OmniTokensPrompt(prompt_token_ids=[1], additional_information={"k": torch.ones(1)})]

    for rid in ("a", "b"):
        build_stage_input(bridge, "bridge", stage(), 2, {0: request_output(rid, [1], [2])}, None, rid)
    assert seen == [["a"], ["b"]]


@pytest.mark.parametrize("result, match", [
    ([], "one input per request; got 0 inputs"),
    ([OmniTokensPrompt(prompt_token_ids=[1])] * 2, "got 2 inputs"),
    ([OmniTokensPrompt(prompt_token_ids=[])], "no prompt_token_ids"),
    ([{"prompt_token_ids": [1], "additional_information": [1]}], "must be a dict"),
])
def test_bad_bridge_results_are_errors(result, match):
    with pytest.raises(ValueError, match=match):
        build_stage_input(lambda *a: result, "b", stage(), 2, {0: request_output("r", [1], [2])}, None, "r")


def test_bridge_exception_names_stage_and_request():
    def broken(*args):
        raise KeyError("code_predictor_codes")

    with pytest.raises(ValueError, match=r"stage 1: broken failed for request r: KeyError"):
        build_stage_input(broken, "broken", stage(), 2, {0: request_output("r", [1], [2])}, None, "r")


def test_mismatched_request_is_an_error():
    with pytest.raises(ValueError, match="belongs to request other"):
        build_stage_input(default_input_processor, "d", stage(), 2, {0: request_output("other", [1], [2])}, None, "r")


def test_default_bridge_signature_is_spec_003():
    views = [StageView(0, [request_output("r", [1], [5, 6])])]
    assert default_input_processor(views, [0], None, False) == [{"prompt_token_ids": [5, 6], "multi_modal_data": None}]


def req(rid, ids):
    return StageRequest(request_id=rid, prompt_token_ids=ids, sampling_params=SamplingParams())


def test_generation_scheduler_is_fifo_and_bounded():
    sched = OmniGenerationScheduler(2)
    for i in range(5):
        sched.add_request(req(str(i), [i]))
    assert sched.abort(["1", "zz"]) == ["1"]
    assert [r.request_id for r in sched.schedule()] == ["0", "2"]
    assert [r.request_id for r in sched.schedule()] == ["3", "4"]
    assert sched.schedule() == [] and not sched.has_unfinished()


class FlakyModel(GenerationModel):
    calls: list[int]

    def __init__(self):
        self.calls = []

    def generate_batch(self, inputs):
        self.calls.append(len(inputs))
        if any(r.request_id == "bad" for r in inputs):
            raise RuntimeError("boom")
        return [{"x": torch.tensor(r.prompt_token_ids)} for r in inputs]


def test_generation_engine_batches_and_isolates_a_failing_request():
    model = FlakyModel()
    engine = GenerationStageEngine(model, OmniGenerationScheduler(4), stage_id=2)
    for rid in ("a", "bad", "c"):
        engine.add_request(req(rid, [1, 2]))
    outs = {o.request_id: o for o in engine.step()}
    assert model.calls == [3, 1, 1, 1]  # one batch, then one by one to find the culprit
    assert outs["bad"].error is not None and "boom" in outs["bad"].error and outs["bad"].finished
    assert torch.equal(outs["a"].multimodal_output["x"], torch.tensor([1, 2])) and outs["c"].error is None
    assert not engine.has_work()


class ChunkDecoder:
    """Decodes whatever has arrived, one unit per chunk (ready while any is pending)."""

    def __init__(self):
        self.pending, self.consumed, self.final = 0, 0, False

    def push(self, units, final):
        self.pending += units.shape[0]
        self.final = final

    def ready(self):
        return self.pending > 0

    @property
    def finished(self):
        return self.final and self.pending == 0


class OneUnitChunks(GenerationModel):
    """A generation model that takes streamed input."""

    accepts_streamed_input = True
    max_units_per_chunk = 1

    @classmethod
    def load(cls, model_path, **kw):
        return cls()

    def generate_batch(self, inputs):
        raise AssertionError("only streams in this test")

    def open_stream(self, req):
        return ChunkDecoder()

    def decode_streams(self, decoders):
        for d in decoders:
            d.pending, d.consumed = d.pending - 1, d.consumed + 1
        # One second of audio a unit: a stream that has played is not due for a while.
        return [{"audio": torch.zeros(10), "sample_rate": torch.tensor(10)} for _ in decoders]


def test_streams_share_the_batch_round_robin():
    """A long stream with a chunk always ready does not hold a one-slot stage: a short stream
    that arrives later is decoded on the next step, not after the long one ends."""
    engine = GenerationStageEngine(OneUnitChunks(), OmniGenerationScheduler(1), stage_id=2)
    engine.add_request(StageRequest(request_id="long", prompt_token_ids=[], sampling_params=SamplingParams(), input_complete=False))
    engine.add_input(StageInputChunk(request_id="long", additional_information={"units": torch.zeros(100)}, final=True))
    assert [o.request_id for o in engine.step()] == ["long"]
    engine.add_request(StageRequest(request_id="short", prompt_token_ids=[], sampling_params=SamplingParams(), input_complete=False))
    engine.add_input(StageInputChunk(request_id="short", additional_information={"units": torch.zeros(1)}, final=True))
    outs = engine.step() + engine.step()
    assert [(o.request_id, o.finished) for o in outs] == [("short", True), ("long", False)]


def test_first_chunks_go_out_in_a_step_of_their_own():
    """A new stream's first chunk is not batched behind the steady chunks of running streams:
    the step after it arrives decodes it alone, then the round robin goes on."""
    model = OneUnitChunks()
    engine = GenerationStageEngine(model, OmniGenerationScheduler(8), stage_id=2)

    def stream(rid, units):
        engine.add_request(StageRequest(request_id=rid, prompt_token_ids=[], sampling_params=SamplingParams(),
                                        input_complete=False))
        engine.add_input(StageInputChunk(request_id=rid, additional_information={"units": torch.zeros(units)},
                                         final=False))

    stream("a", 10)
    stream("b", 10)
    assert sorted(o.request_id for o in engine.step()) == ["a", "b"]
    stream("new", 3)
    assert [o.request_id for o in engine.step()] == ["new"]  # alone, ahead of a and b
    assert sorted(o.request_id for o in engine.step()) == ["a", "b", "new"]


class TwoStreamsPerStep(OneUnitChunks):
    """A model whose steps run well with at most two streams (like code2wav's graphs)."""

    def __init__(self):
        self.calls = []

    def streams_per_step(self, decoders):
        return 2

    def decode_streams(self, decoders):
        self.calls.append(len(decoders))
        return super().decode_streams(decoders)


def test_steps_take_no_more_streams_than_the_model_plans():
    """Five streams with chunks ready: steps of two (round robin), a new stream's first chunk
    still in the next step, ahead of them; every chunk decoded once."""
    model = TwoStreamsPerStep()
    engine = GenerationStageEngine(model, OmniGenerationScheduler(8), stage_id=2)
    for rid in "abcde":
        engine.add_request(StageRequest(request_id=rid, prompt_token_ids=[], sampling_params=SamplingParams(),
                                        input_complete=False))
        engine.add_input(StageInputChunk(request_id=rid, additional_information={"units": torch.zeros(2)},
                                         final=True))
    steps = [sorted(o.request_id for o in engine.step()) for _ in range(3)]
    assert steps == [["a", "b"], ["c", "d"], ["e"]]  # first chunks, two at a time
    engine.add_request(StageRequest(request_id="new", prompt_token_ids=[], sampling_params=SamplingParams(),
                                    input_complete=False))
    engine.add_input(StageInputChunk(request_id="new", additional_information={"units": torch.zeros(1)},
                                     final=True))
    assert [o.request_id for o in engine.step()] == ["new"]
    outs = []
    while engine.has_work():
        outs.append(sorted((o.request_id, o.finished) for o in engine.step()))
    assert outs == [[("a", True), ("b", True)], [("c", True), ("d", True)], [("e", True)]]
    assert model.calls == [2, 2, 1, 1, 2, 2, 1]


class HeldLaunch(Launched):
    """A launched decode that stays on the 'device' until the test releases it."""

    released = False

    def done(self):
        return self.released


class HeldLanes(HostLanes):
    """Overlapping lanes (as CudaLanes) whose launched calls finish when the test says so."""

    overlapping = True

    def __init__(self):
        self.launched = []

    def launch(self, call):
        self.launched.append(HeldLaunch(self.run_now(call)))
        return self.launched[-1]


def _open(engine, rid, units, final=False):
    engine.add_request(StageRequest(request_id=rid, prompt_token_ids=[], sampling_params=SamplingParams(),
                                    input_complete=False))
    engine.add_input(StageInputChunk(request_id=rid, additional_information={"units": torch.zeros(units)},
                                     final=final))


def test_a_first_chunk_does_not_wait_for_later_chunks_on_the_device():
    """Later chunks launched on the device: the next steps decode a new stream's first chunk at
    once, launch nothing more, and the worker polls (no spinning) until the launch is done."""
    lanes = HeldLanes()
    engine = GenerationStageEngine(OneUnitChunks(), OmniGenerationScheduler(8), stage_id=2, lanes=lanes)
    _open(engine, "a", 3)
    _open(engine, "b", 3)
    assert sorted(o.request_id for o in engine.step()) == ["a", "b"]  # first chunks, decoded at once
    assert lanes.launched == []  # nothing else in that step
    assert engine.step() == [] and len(lanes.launched) == 1  # their second chunks are on the device
    assert not engine.has_work() and engine.poll_ms() == 1
    _open(engine, "new", 2)
    assert [o.request_id for o in engine.step()] == ["new"]  # ahead of the launch, which is still held
    assert not engine.has_work()  # new's second chunk is ready, but one launch at a time: no spinning
    assert engine.step() == [] and len(lanes.launched) == 1
    # where the streams are, as the stage reports it (a stalled run's report names these counts)
    assert engine.stats()["counts"] == {"streams": 3, "ready": 1, "new": 0, "on_device": 2}
    lanes.launched[0].released = True
    assert engine.has_work()
    assert sorted(o.request_id for o in engine.step()) == ["a", "b"]


def test_a_launched_decode_ends_its_streams_properly():
    """While a launch is on the device: an aborted stream gets nothing from it; a final push
    that leaves nothing to decode finishes the stream with the launched chunk, not before it;
    a failed step fails the launch's streams."""
    lanes = HeldLanes()
    engine = GenerationStageEngine(OneUnitChunks(), OmniGenerationScheduler(8), stage_id=2, lanes=lanes)
    for rid in ("a", "b", "c"):
        _open(engine, rid, 2)
    engine.step()  # first chunks
    assert engine.step() == []  # the three second chunks launched
    engine.abort(["a"])
    engine.add_input(StageInputChunk(request_id="b", additional_information={}, final=True))
    assert engine.step() == []  # nothing yet for b: its last chunk is on the device
    lanes.launched[0].released = True
    assert sorted((o.request_id, o.finished) for o in engine.step()) == [("b", True), ("c", False)]
    assert not engine.has_work()
    engine.add_input(StageInputChunk(request_id="c", additional_information={"units": torch.zeros(1)},
                                     final=True))
    assert engine.step() == []  # launched
    failed = engine.fail_all("stage 2: engine step failed: device error")
    assert [(o.request_id, o.finished, o.error) for o in failed] == [("c", True, "stage 2: engine step failed: "
                                                                                  "device error")]
    assert engine.stats()["num_unfinished"] == 0


class BreaksOnBad(OneUnitChunks):
    """decode_streams fails any call with the stream opened as "bad" (after its first chunk)."""

    def open_stream(self, req):
        decoder = ChunkDecoder()
        decoder.bad = req.request_id == "bad"
        return decoder

    def decode_streams(self, decoders):
        if any(d.bad and d.consumed for d in decoders):
            raise RuntimeError("boom")
        return super().decode_streams(decoders)


@pytest.mark.parametrize("lanes", [HostLanes, HeldLanes])
def test_a_stream_that_breaks_a_launch_fails_alone(lanes):
    """Later chunks of three streams, one of which breaks the call: retried one by one, the
    culprit fails (and is closed), the others' chunks go out in the same step."""
    engine = GenerationStageEngine(BreaksOnBad(), OmniGenerationScheduler(8), stage_id=2, lanes=lanes())
    for rid in ("a", "bad", "c"):
        _open(engine, rid, 2, final=True)
    assert sorted(o.request_id for o in engine.step()) == ["a", "bad", "c"]  # first chunks
    outs = {o.request_id: o for o in engine.step()}
    assert sorted(outs) == ["a", "bad", "c"]
    assert "boom" in outs["bad"].error and outs["bad"].finished
    assert outs["a"].error is None and outs["a"].finished and outs["c"].finished
    assert not engine.has_work() and engine.stats()["num_unfinished"] == 0


def test_ar_stage_engine_sends_deltas_or_the_final_output_only(tiny_model):
    """DELTA: an output per step whose concatenation is the result; FINAL_ONLY: one output
    holding everything (the engine builds no intermediate outputs for it)."""
    from vllm_omni.core.engine_config import EngineConfig
    from vllm_omni.core.llm_engine import LLMEngine
    from vllm_omni.stage_io import OutputKind
    from vllm_omni.worker.ar_stage_engine import ARStageEngine

    config = EngineConfig(model=str(tiny_model("qwen3")), device="cpu", hidden_state_layers=(0,))
    engine = ARStageEngine(LLMEngine(config), stage_id=0,
                           export_hidden_states=True)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    for kind in OutputKind:
        engine.add_request(StageRequest(request_id=kind.name, prompt_token_ids=[5, 6, 7, 8], sampling_params=params,
                                        output_kind=kind))
    outs: dict[str, list] = {"DELTA": [], "FINAL_ONLY": []}
    while engine.has_work():
        for out in engine.step():
            outs[out.request_id].append(out)
    delta, final = outs["DELTA"], outs["FINAL_ONLY"]
    assert len(delta) == 7 and [o.finished for o in delta] == [False] * 6 + [True]
    assert len(final) == 1 and final[0].finished
    assert [t for o in delta for t in o.new_token_ids] == final[0].new_token_ids and len(final[0].new_token_ids) == 7
    assert "".join(o.new_text for o in delta) == final[0].new_text
    # Hidden states (typed inside the engine) leave with spec 003's string keys: each delta the
    # rows of the positions its step computed (the prompt's in the first), the final output all.
    assert sorted(final[0].multimodal_output) == ["0", "last"]
    assert [o.multimodal_output["last"].shape[0] for o in delta] == [4] + [1] * 6
    for key in ("0", "last"):
        torch.testing.assert_close(torch.cat([o.multimodal_output[key] for o in delta]),
                                   final[0].multimodal_output[key])


def test_a_generation_stage_runs_generation_models_only():
    """The generation engine reads GenerationModel's declared attributes and calls its hooks: a
    class that is not one is refused when the stage starts (it would otherwise fail mid-request)."""
    from vllm_omni.model_executor.models.registry import resolve_generation_model_class

    assert resolve_generation_model_class("Qwen3TTSForConditionalGeneration", "code2wav").__name__ == "Qwen3TTSCode2Wav"
    for arch, stage in (("collections.OrderedDict", None), ("Qwen3TTSForConditionalGeneration", "talker")):
        with pytest.raises(ValueError, match="is not a GenerationModel"):
            resolve_generation_model_class(arch, stage)
    plain = FlakyModel()  # declares nothing: the defaults hold
    assert not plain.accepts_streamed_input and not plain.overlaps_first_chunks and not plain.supports_cuda_graphs
    assert plain.streams_per_step([ChunkDecoder()] * 3) == 3
    with pytest.raises(ValueError, match="takes no chunk options"):
        FlakyModel.stream_config({"codec_chunk_frames": 5})


def test_stage_ready_carries_a_typed_stage_info():
    """What a stage reports when it comes up is decoded into StageInfo's typed fields (streaming
    and prompt-limit decisions read them), and a wrong type is refused while decoding."""
    import msgspec

    from vllm_omni.engine.messages import StageReady
    from vllm_omni.stage_io import StageInfo

    ready = StageReady(1, 2, StageInfo(engine="ar", device="cpu", vocab_size=10, max_model_len=64))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(ready), type=StageReady)
    assert decoded.info.vocab_size == 10 and decoded.info.max_model_len == 64
    assert decoded.info.accepts_streamed_input is False and decoded.info.stream_units_per_chunk is None
    wrong = {"type": "ready", "stage_id": 1, "pid": 2, "info": {"engine": "ar", "device": "cpu", "vocab_size": "10"}}
    with pytest.raises(msgspec.ValidationError, match="vocab_size"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(wrong), type=StageReady)
