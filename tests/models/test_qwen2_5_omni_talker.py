"""Qwen2.5-Omni talker (our AR engine), token2wav and the thinker->talker->code2wav bridges
against transformers on a tiny random checkpoint.

The reference is transformers' own `Qwen2_5OmniForConditionalGeneration.generate`; we record
what its thinker returned, what its talker generated and which codes it handed to token2wav,
then feed the same thinker output through our bridges and engine.

One adjustment to the reference: transformers 5 `generate` drops an all-ones attention mask,
and the talker's forward keys its prompt handling on the mask (adding the codec pad/bos
embeddings, M-RoPE positions from `get_rope_index`), so in transformers 5 that code never
runs for unpadded inputs. transformers 4 always passed a mask; the hook below hands the talker
an all-ones mask again, i.e. the behaviour the released model was built with, which ours follows.
"""
from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.models.streamed_replies import append_next_rows, split_reply  # noqa: E402
from tests.reference.hf_talker import give_talker_a_mask  # noqa: E402
from vllm_omni.core.engine_config import EngineConfig  # noqa: E402
from vllm_omni.core.llm_engine import LLMEngine  # noqa: E402
from vllm_omni.stage_io import StageRequest  # noqa: E402
from vllm_omni.engine.stage_input import StageView  # noqa: E402
from vllm_omni.model_executor.models.registry import resolve_model_class  # noqa: E402
from vllm_omni.model_executor.models.qwen2_5_omni.bridges import (  # noqa: E402
    TalkerInputs,
    talker2code2wav,
    thinker2talker,
)
from vllm_omni.outputs import CompletionOutput, RequestOutput  # noqa: E402
from vllm_omni.sampling_params import SamplingParams  # noqa: E402

CODEC_END, CODEC_PAD = 126, 124  # tiny_omni's codec ids
THINKER_TOKENS, TALKER_TOKENS = 12, 48


@pytest.fixture(scope="module")
def hf_model(omni_dir):
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir, dtype=torch.float32).eval()
    model.talker.register_forward_pre_hook(give_talker_a_mask, with_kwargs=True)
    return model


@contextlib.contextmanager
def recording(model):
    """Record the thinker result, talker result and token2wav codes of one HF generate."""
    rec: dict = {}
    thinker_generate, talker_generate = model.thinker.generate, model.talker.generate

    def thinker(*a, **k):
        rec["thinker"] = thinker_generate(*a, **k)
        return rec["thinker"]

    def talker(*a, **k):
        rec["talker"] = talker_generate(*a, **k)
        return rec["talker"]

    def token2wav(code, **kwargs):  # the codes are what we compare; skip the vocoder here
        rec.setdefault("codes", []).append(code[0].tolist())
        return torch.zeros(1)

    model.thinker.generate, model.talker.generate, model.token2wav.forward = thinker, talker, token2wav
    try:
        yield rec
    finally:
        del model.thinker.generate, model.talker.generate, model.token2wav.forward


def hf_reference(model, ids: torch.Tensor, speaker: str = "Chelsie", **mm):
    with recording(model) as rec, torch.no_grad():
        model.generate(input_ids=ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                       speaker=speaker, thinker_max_new_tokens=THINKER_TOKENS, thinker_do_sample=False,
                       talker_max_new_tokens=TALKER_TOKENS, talker_do_sample=False,
                       talker_eos_token_id=[CODEC_END, CODEC_PAD], **mm)
    return rec


def thinker_output(request_id: str, ids: torch.Tensor, result) -> RequestOutput:
    """The thinker's RequestOutput as our engine exports it: hidden states "0" and "last" of
    every prompt and reply token except the last sampled one."""
    steps = result.hidden_states
    states = {"0": torch.cat([s[0][0] for s in steps]), "last": torch.cat([s[-1][0] for s in steps])}
    reply = result.sequences[0, ids.numel():].tolist()
    comp = CompletionOutput(0, "", reply, finish_reason="length", multimodal_output=states)
    return RequestOutput(request_id, None, ids.tolist(), [comp], finished=True)


def finished_talker_output(request_id: str, codes: list[int], finish_reason: str, stop_reason=None) -> RequestOutput:
    comp = CompletionOutput(0, "", codes, finish_reason=finish_reason, stop_reason=stop_reason)
    return RequestOutput(request_id, None, [0], [comp], finished=True)


def talker_engine(omni_dir) -> LLMEngine:
    # A small token budget chunks the longer prompts, so spans start and end mid-prompt.
    return LLMEngine(EngineConfig(model=str(omni_dir), model_stage="talker", device="cpu", dtype="float32",
                                  enable_prefix_caching=False, max_num_batched_tokens=24, num_kv_blocks=64))


def run_talker(engine: LLMEngine, prompts: dict[str, dict]) -> dict[str, RequestOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=TALKER_TOKENS, repetition_penalty=1.05, detokenize=False)
    for rid, p in prompts.items():
        assert engine.add_request(rid, p["prompt_token_ids"], params, model_inputs=p["additional_information"]) is None
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


# (seed, prompt length, speaker): random text prompts whose talker stops by codec pad, by codec
# end, at the length limit, and at once (an empty speech; transformers' token2wav fails on it).
TEXT_CASES = {"pad-stop": (0, 6, "Chelsie"), "end-stop": (0, 8, "Chelsie"), "length": (0, 12, "Chelsie"),
              "ethan": (0, 9, "Ethan"), "empty": (0, 11, "Chelsie")}


def text_prompt(seed: int, length: int) -> torch.Tensor:
    # Prompts of growing length drawn from one stream; the cases above were picked from it.
    gen = torch.Generator().manual_seed(seed)
    for n in range(6, length + 1):
        ids = torch.randint(0, 420, (n,), generator=gen)
    return ids


def test_talker_codes_match_transformers(omni_dir, hf_model):
    refs, prompts, thinker_outs = {}, {}, {}
    for name, (seed, length, speaker) in TEXT_CASES.items():
        ids = text_prompt(seed, length)
        refs[name] = hf_reference(hf_model, ids, speaker)
        thinker_outs[name] = thinker_output(name, ids, refs[name]["thinker"])
        user_prompt = {"prompt_token_ids": ids.tolist(), "additional_information": {"speaker": speaker}}
        [prompts[name]] = thinker2talker([StageView(0, [thinker_outs[name]])], [0], user_prompt, False)

    engine = talker_engine(omni_dir)
    outs = run_talker(engine, prompts)  # all requests share the engine's batches
    # transformers generates with suppress_tokens=[codec bos]; random weights never pick it anyway.
    assert engine.model.compute_logits(torch.randn(2, engine.model.hidden_size))[:, 125].eq(float("-inf")).all()

    endings = set()
    for name, ref in refs.items():
        num_prompt = len(thinker_outs[name].prompt_token_ids)
        hf_codes = ref["talker"][0, num_prompt + 2:].tolist()
        ours = outs[name].outputs[0]
        assert ours.token_ids == hf_codes, name
        assert outs[name].prompt_token_ids == [127] * num_prompt + [CODEC_PAD, 125]  # HF's talker input ids
        endings.add(ours.token_ids[-1] if ours.finish_reason == "stop" else "length")
        if not ref["codes"][0]:
            with pytest.raises(ValueError, match="no codec codes"):
                talker2code2wav([StageView(0, []), StageView(1, [outs[name]])], [1], None, False)
            continue
        [code2wav_in] = talker2code2wav([StageView(0, []), StageView(1, [outs[name]])], [1],
                                        {"prompt": "x", "additional_information": {"speaker": "Ethan"}}, False)
        assert code2wav_in["prompt_token_ids"] == ref["codes"][0], name  # what HF's token2wav got
        assert code2wav_in["additional_information"] == {"speaker": "Ethan"}
    assert endings == {CODEC_PAD, CODEC_END, "length"}  # every way a talker request ends was covered


def test_streamed_reply_rows_go_to_the_talker_together_at_the_next_step(omni_dir, hf_model, monkeypatch):
    """The thinker's reply rows stream in a row per request per thinker step (as over a
    streaming edge); the talker moves every request's new rows in one transfer per key at its
    next step, none as they arrive, and its codes are still transformers'."""
    from vllm_omni.model_executor.models import bridge_utils
    from vllm_omni.model_executor.models.qwen2_5_omni import talker as talker_module

    uploads = []
    for module in (bridge_utils, talker_module):
        monkeypatch.setattr(module, "rows_like", lambda rows, like, real=module.rows_like: (
            uploads.append(rows.shape[0]), real(rows, like))[1])
    engine = talker_engine(omni_dir)
    params = SamplingParams(temperature=0.0, max_tokens=TALKER_TOKENS, repetition_penalty=1.05, detokenize=False)
    refs, chunks = {}, {}
    for name in ("length", "ethan"):
        seed, length, speaker = TEXT_CASES[name]
        ids = text_prompt(seed, length)
        refs[name] = hf_reference(hf_model, ids, speaker)
        user_prompt = {"prompt_token_ids": ids.tolist(), "additional_information": {"speaker": speaker}}
        [prompt] = thinker2talker([StageView(0, [thinker_output(name, ids, refs[name]["thinker"])])], [0],
                                  user_prompt, False)
        # the talker's prompt ends with the first reply row
        first, chunks[name] = split_reply(prompt["additional_information"], ids.numel() + 1)
        assert len(chunks[name]) >= 3
        engine.add_request(name, prompt["prompt_token_ids"], params, model_inputs=first, input_complete=False)
    done = {}
    while engine.has_unfinished_requests():
        uploads.clear()
        sent = append_next_rows(engine, chunks, done)
        assert uploads == [], "nothing moves to the device as a chunk arrives"
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        assert uploads == ([sent, sent] if sent else []), "one transfer per key of every request's new rows"
    for name, ref in refs.items():
        hf_codes = ref["talker"][0, len(done[name].prompt_token_ids):].tolist()  # after HF's talker prompt
        assert done[name].outputs[0].token_ids == hf_codes, name


def test_talker_multimodal_prompt_matches_transformers(omni_dir, hf_model):
    from vllm_omni.testing.tokenizer import make_tiny_tokenizer

    tid = make_tiny_tokenizer().convert_tokens_to_ids
    audio = [tid("<|audio_bos|>")] + [tid("<|AUDIO|>")] * 25 + [tid("<|audio_eos|>")]  # 100 mel frames
    image = [tid("<|vision_bos|>")] + [tid("<|IMAGE|>")] * 4 + [tid("<|vision_eos|>")]  # grid 1x4x4, merge 2
    ids = torch.tensor([5, 17, *audio, 33, 100, *image, 200, 7])
    gen = torch.Generator().manual_seed(3)
    mm = dict(input_features=torch.randn(1, 128, 100, generator=gen),
              feature_attention_mask=torch.ones(1, 100, dtype=torch.long),
              pixel_values=torch.randn(16, 3 * 2 * 14 * 14, generator=gen),
              image_grid_thw=torch.tensor([[1, 4, 4]]))
    ref = hf_reference(hf_model, ids, input_features=mm["input_features"],
                       feature_attention_mask=mm["feature_attention_mask"],
                       thinker_pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"])
    # The processed prompt the thinker stage ran (its model_inputs) carries the layout.
    user_prompt = {"prompt_token_ids": ids.tolist(), "additional_information": mm}
    [talker_in] = thinker2talker([StageView(0, [thinker_output("mm", ids, ref["thinker"])])], [0], user_prompt, False)
    assert talker_in["additional_information"]["image_grid_thw"].tolist() == [[1, 4, 4]]

    out = run_talker(talker_engine(omni_dir), {"mm": talker_in})["mm"]
    assert out.outputs[0].token_ids == ref["talker"][0, ids.numel() + 2:].tolist()

    # Without the grid the image positions are unknowable: the request is refused up front.
    info = {k: v for k, v in talker_in["additional_information"].items() if k != "image_grid_thw"}
    with pytest.raises(ValueError, match="image_grid_thw"):
        talker_engine(omni_dir).add_request("bad", talker_in["prompt_token_ids"], SamplingParams(), model_inputs=info)


def test_token2wav_matches_transformers_and_ignores_batch(omni_dir, hf_model):
    from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler
    from vllm_omni.worker.generation_stage_engine import GenerationStageEngine

    model_cls = resolve_model_class("Qwen2_5OmniForConditionalGeneration", "code2wav")
    ours = model_cls.load(str(omni_dir), model_stage="code2wav", device=torch.device("cpu"), dtype="auto")
    gen = torch.Generator().manual_seed(5)
    codes = {"a": torch.randint(0, 124, (20,), generator=gen), "c": torch.randint(0, 124, (13,), generator=gen)}

    def request(rid, code_key, seed, speaker=None):
        info = {"num_steps": 3, **({"speaker": speaker} if speaker else {})}
        return StageRequest(request_id=rid, prompt_token_ids=codes[code_key].tolist(),
                            sampling_params=SamplingParams(seed=seed), additional_information=info)

    def hf_wav(code_key, seed, speaker="Chelsie"):
        spk = hf_model.speaker_map[speaker]
        torch.manual_seed(seed)
        with torch.no_grad():
            return hf_model.token2wav(codes[code_key][None], conditioning=spk["cond"].float(),
                                      reference_mel=spk["ref_mel"].float(), num_steps=3).reshape(-1)

    # Same code length and speaker: one batched pass with per-request noise; "c" runs apart.
    batch = [request("a", "a", 7), request("b", "a", 8), request("c", "c", 7, "Ethan"), request("e", "a", 7)]
    engine = GenerationStageEngine(ours, OmniGenerationScheduler(len(batch)), stage_id=2)
    for req in batch:
        engine.add_request(req)
    wavs = {o.request_id: o.multimodal_output["audio"] for o in engine.step()}
    assert wavs["a"].dtype == torch.float32 and wavs["a"].shape == (20 * 2 * 20,)  # 2 mel frames/code, hop 20
    torch.testing.assert_close(wavs["a"], hf_wav("a", 7), atol=1e-4, rtol=0)
    torch.testing.assert_close(wavs["b"], hf_wav("a", 8), atol=1e-4, rtol=0)
    torch.testing.assert_close(wavs["c"], hf_wav("c", 7, "Ethan"), atol=1e-4, rtol=0)
    torch.testing.assert_close(wavs["e"], wavs["a"], atol=1e-5, rtol=0)  # seed, not batch slot, decides
    [alone] = ours.generate_batch([request("a", "a", 7)])
    torch.testing.assert_close(alone["audio"], wavs["a"], atol=1e-5, rtol=0)
    assert not torch.allclose(wavs["a"], wavs["b"])

    with pytest.raises(ValueError, match="unknown speaker"):
        ours.generate_batch([request("x", "a", 7, "Nobody")])
    bad = StageRequest(request_id="x", prompt_token_ids=[500], sampling_params=SamplingParams(seed=1))
    with pytest.raises(ValueError, match="codec codes"):
        ours.generate_batch([bad])


def test_bridges_keep_requests_apart(omni_dir, hf_model):
    refs = {name: hf_reference(hf_model, text_prompt(0, n)) for name, n in (("r1", 6), ("r2", 9))}
    outs = {name: thinker_output(name, text_prompt(0, n), refs[name]["thinker"]) for name, n in (("r1", 6), ("r2", 9))}

    both = thinker2talker([StageView(0, [outs["r1"], outs["r2"]])], [0], None, False)
    for name, got in zip(("r1", "r2"), both):
        [alone] = thinker2talker([StageView(0, [outs[name]])], [0], None, False)
        assert got["prompt_token_ids"] == alone["prompt_token_ids"]
        a = TalkerInputs.from_info(got["additional_information"])
        b = TalkerInputs.from_info(alone["additional_information"])
        assert a.thinker_prompt_token_ids == outs[name].prompt_token_ids == b.thinker_prompt_token_ids
        assert torch.equal(a.thinker_hidden, b.thinker_hidden) and torch.equal(a.thinker_embeds, b.thinker_embeds)
    assert len(both[0]["prompt_token_ids"]) == 6 + 2 and len(both[1]["prompt_token_ids"]) == 9 + 2

    with pytest.raises(ValueError, match="repeat request ids"):
        thinker2talker([StageView(0, [outs["r1"], outs["r1"]])], [0], None, False)
    # Hidden states of another request (wrong row count) are refused, not spliced in.
    mixed = thinker_output("r1", text_prompt(0, 6), refs["r1"]["thinker"])
    mixed.outputs[0].multimodal_output["last"] = outs["r2"].outputs[0].multimodal_output["last"]
    with pytest.raises(ValueError, match="rows"):
        thinker2talker([StageView(0, [mixed])], [0], None, False)
    with pytest.raises(ValueError, match="unknown key"):
        TalkerInputs.from_info({**both[0]["additional_information"], "stray": 1})

    talker_outs = [finished_talker_output("t1", [1, 2, CODEC_END], "stop", None),
                   finished_talker_output("t2", [3, 4, 5], "length"),
                   finished_talker_output("t3", [6, 7, 99], "stop", 99)]
    codes = [p["prompt_token_ids"] for p in talker2code2wav([StageView(0, []), StageView(1, talker_outs)], [1])]
    assert codes == [[1, 2], [3, 4, 5], [6, 7]]


def test_registry_resolves_talker_and_code2wav():
    for arch in ("Qwen2_5OmniForConditionalGeneration", "Qwen2_5OmniModel"):
        assert resolve_model_class(arch, "talker").__name__ == "Qwen2_5OmniTalkerForConditionalGeneration"
        assert resolve_model_class(arch, "code2wav").__name__ == "Qwen2_5OmniToken2Wav"


def test_our_thinker_feeds_the_talker_like_transformers(omni_dir, hf_model):
    """End to end on our engines: thinker (exporting hidden states "0" and "last") -> bridge -> talker."""
    ids = text_prompt(*TEXT_CASES["pad-stop"][:2])
    ref = hf_reference(hf_model, ids)
    thinker = LLMEngine(EngineConfig(model=str(omni_dir), model_stage="thinker", device="cpu", dtype="float32",
                                     enable_prefix_caching=False, hidden_state_layers=(0,), num_kv_blocks=64))
    thinker.add_request("r", ids.tolist(), SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS, detokenize=False),
                        return_hidden_states=True)
    out = None
    while thinker.has_unfinished_requests():
        out = next((o for o in thinker.step() if o.finished), out)
    assert out.outputs[0].token_ids == ref["thinker"].sequences[0, ids.numel():].tolist()
    [talker_in] = thinker2talker([StageView(0, [out])], [0], None, False)
    codes = run_talker(talker_engine(omni_dir), {"r": talker_in})["r"].outputs[0].token_ids
    assert codes == ref["talker"][0, ids.numel() + 2:].tolist()
