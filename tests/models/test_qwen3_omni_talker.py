"""Qwen3-Omni talker (our AR engine + code predictor), code2wav and the thinker->talker->code2wav
bridges against transformers on a tiny random checkpoint (float32, CPU).

The reference is transformers' own `Qwen3OmniMoeForConditionalGeneration.generate` (greedy):
we record what its thinker returned and what its talker generated (group-0 codes and the
residual codes of every frame), feed the same thinker output through our bridge and engine,
and compare every code group of every frame.

The tiny talker never picks codec EOS by itself, so the checkpoint is edited once: the EOS row
of `codec_head` becomes 1.001 x the row of code 29, which the "story" prompt reaches at step 6
(and the "friend" prompt never): that request ends by EOS exactly where code 29 would have
won, both in transformers and here, and the other runs to its length limit.
"""
from __future__ import annotations

import contextlib
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler  # noqa: E402
from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni.stage_io import StageRequest  # noqa: E402
from vllm_omni.worker.generation_stage_engine import GenerationStageEngine  # noqa: E402
from vllm_omni.engine.stage_input import StageView  # noqa: E402
from vllm_omni.model_executor.models.registry import resolve_model_class  # noqa: E402
from vllm_omni.model_executor.models.qwen3_omni.bridges import (  # noqa: E402
    CODES_KEY,
    TalkerInputs,
    talker2code2wav,
    thinker2talker,
)
from vllm_omni.outputs import CompletionOutput, RequestOutput  # noqa: E402
from vllm_omni.sampling_params import SamplingParams  # noqa: E402
from vllm_omni.testing.engine_runs import EngineRun  # noqa: E402
from tests.models.predictor_frames import check_frame_matches_eager_predictor  # noqa: E402
from tests.models.streamed_replies import append_next_rows, split_reply  # noqa: E402

ARCH = "Qwen3OmniMoeForConditionalGeneration"
ACCEPT_LAYER = 1  # the tiny talker's accept_hidden_layer
CODEC_EOS, EOS_LIKE = 66, 29  # tiny codec EOS (codebook 64 + 2) and the code it is made to shadow
THINKER_TOKENS, TALKER_TOKENS = 8, 16
PROMPTS = {"friend": ("You are nice", "hello there friend", "Ethan"),  # runs to the length limit
           "story": (None, "tell me a story about cats", "chelsie")}  # ends by codec EOS at step 6


@pytest.fixture(scope="module")
def ckpt(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-omni-eos")
    shutil.copytree(tiny_model("qwen3_omni_moe"), path, dirs_exist_ok=True)
    weights = load_file(path / "model.safetensors")
    head = weights["talker.codec_head.weight"]
    head[CODEC_EOS] = head[EOS_LIKE] * 1.001
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from vllm_omni.testing.tiny_qwen3_omni import prepare_reference

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    prepare_reference(model)
    return model


@pytest.fixture(scope="module")
def tok(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


def chat(tok, system: str | None, user: list[int] | str) -> list[int]:
    t = tok.convert_tokens_to_ids
    user_ids = tok(user)["input_ids"] if isinstance(user, str) else user
    ids = [t("<|im_start|>"), t("system"), 198, *tok(system)["input_ids"], t("<|im_end|>"), 198] if system else []
    return ids + [t("<|im_start|>"), t("user"), 198, *user_ids, t("<|im_end|>"), 198,
                  t("<|im_start|>"), t("assistant"), 198]


@contextlib.contextmanager
def recording(model):
    rec: dict = {}
    thinker_generate, talker_generate = model.thinker.generate, model.talker.generate

    def thinker(*a, **k):
        rec["thinker"] = thinker_generate(*a, **k)
        return rec["thinker"]

    def talker(*a, **k):
        rec["talker"] = talker_generate(*a, **k)
        return rec["talker"]

    model.thinker.generate, model.talker.generate = thinker, talker
    try:
        yield rec
    finally:
        del model.thinker.generate, model.talker.generate


def hf_reference(hf, tok, ids: list[int], speaker: str, **mm) -> dict:
    with recording(hf) as rec, torch.no_grad():
        hf.generate(input_ids=torch.tensor([ids]), speaker=speaker, thinker_max_new_tokens=THINKER_TOKENS,
                    thinker_do_sample=False, thinker_eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                    talker_max_new_tokens=TALKER_TOKENS, talker_do_sample=False, **mm)
    talker = rec["talker"]
    # transformers' own frames: residual codes of every step (the last sampled token has none).
    frames = torch.stack([h[-1] for h in talker.hidden_states if h[-1] is not None], dim=1)[0]
    return {"thinker": rec["thinker"], "tokens": talker.sequences[0].tolist(), "frames": frames}


def thinker_output(request_id: str, ids: list[int], result) -> RequestOutput:
    """The thinker's RequestOutput as our engine exports it: hidden states "0" and the accept
    layer of every prompt and reply token except the last sampled one."""
    steps = result.hidden_states
    states = {key: torch.cat([s[layer][0] for s in steps]) for key, layer in (("0", 0), ("1", ACCEPT_LAYER))}
    states["last"] = torch.cat([s[-1][0] for s in steps])
    comp = CompletionOutput(0, "", result.sequences[0, len(ids):].tolist(), finish_reason="stop",
                            multimodal_output=states)
    return RequestOutput(request_id, None, list(ids), [comp], finished=True)


def talker_engine(ckpt, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), model_stage="talker", architecture=ARCH, device="cpu",
                                  dtype="float32", enable_prefix_caching=False, **kwargs))


def run_talker(engine: LLMEngine, prompts: dict[str, dict]) -> dict[str, RequestOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=TALKER_TOKENS, repetition_penalty=1.05, detokenize=False)
    run = EngineRun(engine)
    for rid, p in prompts.items():
        assert run.add(rid, p["prompt_token_ids"], params, model_inputs=p["additional_information"])
    return run.run()


def check_against_reference(name: str, ours: RequestOutput, ref: dict) -> None:
    comp = ours.outputs[0]
    assert comp.token_ids == ref["tokens"], name
    frames = comp.multimodal_output[CODES_KEY]
    assert frames.dtype == torch.long and frames.shape[1] == 4
    # transformers computes no frame for the last sampled token: the EOS, which we leave out too,
    # or at a length stop a real frame, which we keep (one frame more than transformers).
    assert ref["frames"].shape[0] == len(ref["tokens"]) - 1
    assert frames.shape[0] == len(ref["tokens"]) - (comp.finish_reason == "stop"), name
    assert torch.equal(frames[: ref["frames"].shape[0]], ref["frames"]), name
    [code2wav_in] = talker2code2wav([StageView(0, []), StageView(1, [ours])], [1], None, False)
    assert code2wav_in["prompt_token_ids"] == frames.T.reshape(-1).tolist(), name  # codebook-major


@pytest.fixture(scope="module")
def text_refs(hf, tok):
    refs, inputs = {}, {}
    for name, (system, user, speaker) in PROMPTS.items():
        ids = chat(tok, system, user)
        refs[name] = hf_reference(hf, tok, ids, speaker)
        user_prompt = {"prompt_token_ids": ids, "additional_information": {"speaker": speaker}}
        [inputs[name]] = thinker2talker([StageView(0, [thinker_output(name, ids, refs[name]["thinker"])])], [0],
                                        user_prompt, False)
    return refs, inputs


def test_talker_codes_match_transformers(ckpt, text_refs):
    refs, inputs = text_refs
    engine = talker_engine(ckpt, max_num_batched_tokens=16)  # chunked prompts, shared batches
    outs = run_talker(engine, inputs)
    assert {name: outs[name].outputs[0].finish_reason for name in refs} == {"friend": "length", "story": "stop"}
    assert outs["story"].outputs[0].token_ids[-1] == CODEC_EOS
    for name, ref in refs.items():
        check_against_reference(name, outs[name], ref)
        assert set(outs[name].prompt_token_ids) == {64}  # codec pad placeholders: nothing penalized
    # transformers' suppress_tokens: the last 1024 codes except EOS.
    logits = engine.model.compute_logits(torch.randn(2, engine.model.hidden_size))
    assert logits[:, 64:].isinf().sum() == 2 * (1088 - 64 - 1) and logits[:, CODEC_EOS].isfinite().all()


def test_talker_lays_out_each_prompt_once(ckpt, text_refs, monkeypatch):
    """Admitting a request lays its talker prompt out once (host work a burst of arrivals pays
    per request before the talker's first step), and its state reuses that layout."""
    from vllm_omni.model_executor.models.qwen3_omni import qwen3_omni_moe_talker as talker_module

    refs, inputs = text_refs
    calls = []
    layout = talker_module.talker_prompt
    monkeypatch.setattr(talker_module, "talker_prompt", lambda *a, **k: (calls.append(1), layout(*a, **k))[1])
    outs = run_talker(talker_engine(ckpt), inputs)
    assert len(calls) == len(inputs)
    for name, ref in refs.items():
        check_against_reference(name, outs[name], ref)


def test_streamed_reply_rows_are_projected_together_at_the_next_step(ckpt, text_refs, monkeypatch):
    """The thinker's reply rows stream in a row per request per thinker step (as over a
    streaming edge); the talker projects every request's new rows in one call at its next step,
    none as they arrive (at 32 in flight, a projection per chunk kept the talker from stepping),
    and its codes are still transformers'."""
    refs, inputs = text_refs
    engine = talker_engine(ckpt)
    projection, rows_per_call = engine.model.text_projection, []
    forward = projection.forward
    monkeypatch.setattr(projection, "forward", lambda x: (rows_per_call.append(x.shape[0]), forward(x))[1])
    params = SamplingParams(temperature=0.0, max_tokens=TALKER_TOKENS, repetition_penalty=1.05, detokenize=False)
    chunks, run = {}, EngineRun(engine)
    for rid, p in inputs.items():
        info = p["additional_information"]
        start = len(info["thinker_prompt_token_ids"]) + 1  # the talker's prompt ends with the first reply row
        first, chunks[rid] = split_reply(info, start)
        assert len(chunks[rid]) >= 3
        run.add(rid, p["prompt_token_ids"], params, model_inputs=first, input_complete=False)
    done = {}
    while engine.has_unfinished_requests():
        sent = append_next_rows(engine, chunks, done)
        rows_per_call.clear()  # (a final chunk projects the constant tts_eos row as it arrives)
        done.update((o.request_id, o) for o in run.step())
        assert rows_per_call == ([sent] if sent else []), "one projection of every request's new rows a step"
    for name, ref in refs.items():
        check_against_reference(name, done[name], ref)


def test_talker_survives_preemption(ckpt, text_refs, monkeypatch):
    """Frames live in the request's model_state: recomputed requests keep their codes."""
    from vllm_omni.core.request import Request

    refs, inputs = text_refs
    calls = []
    reset = Request.reset_for_recompute
    monkeypatch.setattr(Request, "reset_for_recompute", lambda self: (calls.append(self.request_id), reset(self))[1])
    outs = run_talker(talker_engine(ckpt, num_kv_blocks=8, block_size=8, max_model_len=48), inputs)
    assert calls, "the small KV pool was meant to force a preemption"
    for name, ref in refs.items():
        check_against_reference(name, outs[name], ref)


def test_talker_sampling_is_seeded(ckpt, text_refs):
    """Sampled talker (and code predictor: top-k 50, top-p 0.8) depends on the seed alone."""
    _, inputs = text_refs

    def run(seed: int, batch: tuple[str, ...]) -> torch.Tensor:
        engine = talker_engine(ckpt)
        params = SamplingParams(temperature=0.9, top_k=50, max_tokens=8, seed=seed, detokenize=False)
        run = EngineRun(engine)
        for rid in batch:
            p = inputs[rid]
            run.add(rid, p["prompt_token_ids"], params, model_inputs=p["additional_information"])
        return run.run()["friend"].outputs[0].multimodal_output[CODES_KEY]

    first = run(1, ("friend",))
    assert torch.equal(first, run(1, ("story", "friend")))  # batch neighbours change nothing
    assert not torch.equal(first, run(2, ("friend",)))


def test_talker_multimodal_prompt_matches_transformers(ckpt, hf, tok):
    """Image + audio in the user turn: hidden_projection rows and M-RoPE positions."""
    t = tok.convert_tokens_to_ids
    gen = torch.Generator().manual_seed(3)
    grid = torch.tensor([[1, 4, 4]])  # 4 image tokens after the 2x2 merge
    mm = {"input_features": torch.randn(1, 128, 100, generator=gen),
          "feature_attention_mask": torch.ones(1, 100, dtype=torch.long),  # 13 audio tokens
          "pixel_values": torch.randn(16, 3 * 2 * 16 * 16, generator=gen), "image_grid_thw": grid}
    image = [t("<|vision_start|>")] + [t("<|image_pad|>")] * 4 + [t("<|vision_end|>")]
    audio = [t("<|audio_start|>")] + [t("<|audio_pad|>")] * 13 + [t("<|audio_end|>")]
    user = image + tok(" look")["input_ids"] + audio + tok(" and listen")["input_ids"]
    ids = chat(tok, "You are nice", user)
    ref = hf_reference(hf, tok, ids, "Ethan", **mm)
    user_prompt = {"prompt_token_ids": ids, "additional_information": mm}  # the thinker's processed prompt
    [talker_in] = thinker2talker([StageView(0, [thinker_output("mm", ids, ref["thinker"])])], [0], user_prompt, False)
    assert talker_in["additional_information"]["image_grid_thw"].tolist() == [[1, 4, 4]]
    engine = talker_engine(ckpt)
    check_against_reference("mm", run_talker(engine, {"mm": talker_in})["mm"], ref)

    # A layout that does not fit the prompt is refused for that request alone.
    bad = {**talker_in["additional_information"], "image_grid_thw": torch.tensor([[1, 8, 8]])}
    with pytest.raises(ValueError, match="M-RoPE"):
        engine.add_request("bad", talker_in["prompt_token_ids"], SamplingParams(), model_inputs=bad)


def test_code2wav_matches_transformers_and_batches(ckpt, hf):
    model_cls = resolve_model_class(ARCH, "code2wav")
    ours = model_cls.load(str(ckpt), model_stage="code2wav", device=torch.device("cpu"), dtype="auto")
    gen = torch.Generator().manual_seed(5)
    codes = {name: torch.randint(0, 64, (4, n), generator=gen) for name, n in (("a", 20), ("b", 7), ("c", 310))}

    def request(rid, frames):
        return StageRequest(request_id=rid, prompt_token_ids=frames.reshape(-1).tolist(),
                            sampling_params=SamplingParams())

    engine = GenerationStageEngine(ours, OmniGenerationScheduler(4), stage_id=2)
    for rid, frames in codes.items():
        engine.add_request(request(rid, frames))
    engine.add_request(StageRequest(request_id="empty", prompt_token_ids=[], sampling_params=SamplingParams()))
    wavs = {o.request_id: o.multimodal_output["audio"] for o in engine.step()}
    for rid, frames in codes.items():  # "c" spans two 300-frame chunks; one batch of all lengths
        with torch.no_grad():
            ref = hf.code2wav.chunked_decode(frames[None], chunk_size=300, left_context_size=25).reshape(-1)
        assert wavs[rid].dtype == torch.float32 and wavs[rid].shape == ref.shape
        torch.testing.assert_close(wavs[rid], ref, atol=1e-4, rtol=0)
        [alone] = ours.generate_batch([request(rid, frames)])
        torch.testing.assert_close(alone["audio"], wavs[rid], atol=1e-5, rtol=0)
    assert wavs["empty"].numel() == 0
    with pytest.raises(ValueError, match="whole number of frames"):
        ours.generate_batch([request("x", torch.tensor([1, 2, 3]))])
    with pytest.raises(ValueError, match="must lie in"):
        ours.generate_batch([request("x", torch.full((4, 1), 64))])


def synthetic_thinker_output(rid: str, ids: list[int], num_reply: int, seed: int) -> RequestOutput:
    gen = torch.Generator().manual_seed(seed)
    rows = len(ids) + num_reply - 1
    states = {k: torch.randn(rows, 64, generator=gen) for k in ("0", "1", "last")}
    comp = CompletionOutput(0, "", list(range(num_reply)), finish_reason="stop", multimodal_output=states)
    return RequestOutput(rid, None, ids, [comp], finished=True)


def synthetic_talker_output(rid: str, tokens: list[int], frames: torch.Tensor, finish: str, stop_reason=None):
    comp = CompletionOutput(0, "", tokens, finish_reason=finish, stop_reason=stop_reason,
                            multimodal_output={CODES_KEY: frames})
    return RequestOutput(rid, None, [64] * 5, [comp], finished=True)


def test_bridges_keep_requests_apart(tok):
    outs = [synthetic_thinker_output("r1", chat(tok, None, "hi"), 3, 0),
            synthetic_thinker_output("r2", chat(tok, "Be brief", "hello there"), 5, 1)]
    both = thinker2talker([StageView(0, outs)], [0], {"prompt": "x", "additional_information": {"speaker": "chelsie"}})
    for out, got in zip(outs, both):
        [alone] = thinker2talker([StageView(0, [out])], [0], None, False)
        a = TalkerInputs.from_info(got["additional_information"])
        b = TalkerInputs.from_info(alone["additional_information"])
        assert a.thinker_prompt_token_ids == out.prompt_token_ids == b.thinker_prompt_token_ids
        assert a.thinker_hidden_layer == ACCEPT_LAYER and (a.speaker, b.speaker) == ("chelsie", None)
        states = out.outputs[0].multimodal_output
        assert torch.equal(a.thinker_embeds, states["0"]) and torch.equal(b.thinker_hidden, states["1"])
        assert len(got["prompt_token_ids"]) == len(out.prompt_token_ids)
    with pytest.raises(ValueError, match="repeat request ids"):
        thinker2talker([StageView(0, [outs[0], outs[0]])], [0])
    mixed = synthetic_thinker_output("r1", outs[0].prompt_token_ids, 3, 0)
    mixed.outputs[0].multimodal_output["1"] = outs[1].outputs[0].multimodal_output["1"]  # another request's rows
    with pytest.raises(ValueError, match="rows"):
        thinker2talker([StageView(0, [mixed])], [0])
    mixed.outputs[0].multimodal_output["2"] = mixed.outputs[0].multimodal_output["1"]
    with pytest.raises(ValueError, match="exactly one thinker layer"):
        thinker2talker([StageView(0, [mixed])], [0])
    with pytest.raises(ValueError, match="at least 2"):
        thinker2talker([StageView(0, [synthetic_thinker_output("r3", outs[0].prompt_token_ids, 1, 0)])], [0])

    frames = torch.arange(12).view(3, 4)
    talker_outs = [synthetic_talker_output("eos", [0, 4, CODEC_EOS], frames[:2], "stop"),  # EOS frame not exported
                   synthetic_talker_output("len", [0, 4, 8], frames, "length"),
                   synthetic_talker_output("stop-id", [0, 4, 8], frames, "stop", 8)]  # a stop id's frame is dropped
    codes = [p["prompt_token_ids"] for p in talker2code2wav([StageView(0, []), StageView(1, talker_outs)], [1])]
    flat = [f.T.reshape(-1).tolist() for f in (frames[:2], frames, frames[:2])]  # codebook-major
    assert codes == flat
    with pytest.raises(ValueError, match="do not match"):
        talker2code2wav([StageView(1, [synthetic_talker_output("x", [1, 4, 8], frames, "length")])], [0])
    with pytest.raises(ValueError, match="no codec codes"):
        talker2code2wav([StageView(1, [synthetic_talker_output("x", [CODEC_EOS], frames[:0], "stop")])], [0])


def test_talker_refuses_bad_requests(ckpt, tok):
    engine = talker_engine(ckpt)
    out = synthetic_thinker_output("r", chat(tok, None, "hi"), 3, 0)
    [good] = thinker2talker([StageView(0, [out])], [0])
    info = good["additional_information"]
    for bad, match in (({**info, "speaker": "nobody"}, "unknown speaker"),
                       ({**info, "thinker_hidden_layer": 2}, "accept_hidden_layer"),
                       ({**info, "thinker_prompt_token_ids": tok("no turns")["input_ids"]}, "assistant")):
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", good["prompt_token_ids"], SamplingParams(), model_inputs=bad)


def test_registry_resolves_talker_and_code2wav():
    from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni import STAGES, stage_model_class

    assert resolve_model_class(ARCH, "talker").__name__ == "Qwen3OmniMoeTalkerForConditionalGeneration"
    assert resolve_model_class(ARCH, "code2wav").__name__ == "Qwen3OmniMoeCode2Wav"
    assert [stage_model_class(s) for s in STAGES] == [resolve_model_class(ARCH, s) for s in STAGES]


def test_predictor_frame_function_matches_the_eager_predictor(ckpt):
    """The function the code predictor's CUDA graphs capture, run eagerly (predictor_frames.py)."""
    check_frame_matches_eager_predictor(talker_engine(ckpt).model, [3, 11, 20])
