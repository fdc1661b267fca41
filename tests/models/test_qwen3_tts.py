"""Qwen3-TTS on our engine against qwen-tts 0.1.1 (the reference implementation), CPU float32.

qwen-tts pins transformers 4.57, so it runs in its own venv; its outputs on the tiny checkpoints
are committed under tests/reference/qwen_tts/fixtures (regenerate.sh rebuilds them, see
docs/tts.md). `test_fixtures_match_the_tiny_checkpoints` fails when a builder or case change
made them stale.

Greedy codes of every group must be identical and the waveform equal within 1e-4, for every task
type and case, with all cases of a task batched together (decoded one by one the waveforms are
bit-identical; batched convolutions round differently, by ~1e-5).
qwen-tts samples with `torch.multinomial` on the global RNG; our sampler draws an exponential
race from a per-request generator, so sampled codes cannot be compared draw for draw: sampling
is checked for seeded reproducibility instead.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.llm_engine import LLMEngine
from vllm_omni.model_executor.models.qwen3_tts.bridges import talker2code2wav
from vllm_omni.model_executor.models.qwen3_tts.code2wav import Qwen3TTSCode2Wav
from vllm_omni.multimodal.qwen3_tts_input import Qwen3TTSInputProcessor
from vllm_omni.model_executor.models.qwen3_tts.tts_request import CODES_KEY, REF_CODES_KEY
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.stage_io import StageRequest
from tests.models.codec_streams import audio_of, open_empty, run_stream
from tests.models.predictor_frames import check_frame_matches_eager_predictor

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "qwen_tts"
sys.path.insert(0, str(REFERENCE))
from cases import CASES, CHECKPOINTS, MAX_NEW_TOKENS, REF_SAMPLE_RATE, SEED, reference_audio  # noqa: E402

ARCH = "Qwen3TTSForConditionalGeneration"
WAVE_ATOL = 1e-4
TASKS = list(CASES)  # fixture names: the task types, and the 0.6B checkpoints (cases.CHECKPOINTS)


def fixture(task: str) -> dict:
    return json.loads((REFERENCE / "fixtures" / f"{task}.json").read_text())


@pytest.fixture(scope="module")
def checkpoints(tiny_model):
    return {name: tiny_model("qwen3_tts", seed=SEED, **CHECKPOINTS[name]) for name in TASKS}


def task_type(name: str) -> str:
    return CHECKPOINTS[name]["task_type"]


def talker_engine(ckpt: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), model_stage="talker", architecture=ARCH, device="cpu"))


def case_prompt(task: str, case: dict) -> dict:
    prompt = {"prompt": case["text"], "language": case["language"]}
    for ours, theirs in (("speaker", "speaker"), ("instructions", "instruct"), ("ref_text", "ref_text"),
                         ("x_vector_only_mode", "x_vector_only_mode"), ("non_streaming_mode", "non_streaming_mode")):
        if theirs in case:
            prompt[ours] = case[theirs]
    if task == "Base":
        prompt["ref_audio"] = (np.asarray(reference_audio(), dtype=np.float32), REF_SAMPLE_RATE)
    return prompt


def greedy() -> SamplingParams:
    # qwen-tts: min_new_tokens=2, repetition_penalty 1.05 (generation_config); its last sampled
    # token never gets a frame (the loop stops before expanding it), hence one token less.
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS - 1, repetition_penalty=1.05, min_tokens=2)


def run_talker(engine: LLMEngine, prompts: dict[str, dict], params: dict[str, SamplingParams]) -> dict:
    for rid, p in prompts.items():
        assert engine.add_request(rid, p["prompt_token_ids"], params[rid],
                                  model_inputs=p["additional_information"]) is None
    done = {}
    for _ in range(500):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        if len(done) == len(prompts):
            return done
    raise AssertionError(f"talker did not finish: {sorted(set(prompts) - set(done))}")


def decode(code2wav: Qwen3TTSCode2Wav, outputs: dict) -> dict[str, np.ndarray]:
    class _Stage:
        engine_outputs = list(outputs.values())

    inputs = talker2code2wav([_Stage()], [0])
    requests = [StageRequest(request_id=rid, prompt_token_ids=p["prompt_token_ids"], sampling_params=SamplingParams(),
                             additional_information=p.get("additional_information") or {})
                for rid, p in zip(outputs, inputs)]
    return {r.request_id: out["audio"].numpy() for r, out in zip(requests, code2wav.generate_batch(requests))}


def test_fixtures_match_the_tiny_checkpoints(checkpoints):
    """The committed qwen-tts outputs were made from exactly these checkpoints and cases."""
    cases_hash = hashlib.sha256((REFERENCE / "cases.py").read_bytes()).hexdigest()
    for task, ckpt in checkpoints.items():
        record = fixture(task)
        current = {str(p.relative_to(ckpt)): hashlib.sha256(p.read_bytes()).hexdigest()
                   for p in sorted(ckpt.rglob("*")) if p.is_file()}
        stale = "stale qwen-tts fixtures: run bash tests/reference/qwen_tts/regenerate.sh (docs/tts.md)"
        assert record["checkpoint_sha256"] == current, f"{task}: {stale}"
        assert record["cases_sha256"] == cases_hash, f"{task}: {stale}"
        assert sorted(record["cases"]) == sorted(c["name"] for c in CASES[task])


@pytest.mark.parametrize("task", TASKS)
def test_greedy_codes_and_waveform_match_qwen_tts(checkpoints, task):
    ckpt = checkpoints[task]
    engine = talker_engine(ckpt)
    processor = Qwen3TTSInputProcessor(ckpt, engine.tokenizer)
    prompts = {c["name"]: processor.process(case_prompt(task_type(task), c)) for c in CASES[task]}
    outputs = run_talker(engine, prompts, {rid: greedy() for rid in prompts})
    waves = decode(Qwen3TTSCode2Wav.load(str(ckpt)), outputs)
    expected = fixture(task)
    reference_waves = np.load(REFERENCE / "fixtures" / f"{task}_waveforms.npz")
    for name, out in outputs.items():
        codes = out.outputs[0].multimodal_output[CODES_KEY]
        assert codes.tolist() == expected["cases"][name]["codes"], f"{task}/{name}: codes differ from qwen-tts"
        reference = reference_waves[name]
        assert waves[name].shape == reference.shape, f"{task}/{name}"
        np.testing.assert_allclose(waves[name], reference, rtol=0, atol=WAVE_ATOL, err_msg=f"{task}/{name}")
    if task_type(task) == "Base":  # the voice-clone prompt: the reference audio's codes (Mimi encoder)
        ref_codes = outputs["icl_clone"].outputs[0].multimodal_output[REF_CODES_KEY]
        assert ref_codes.tolist() == expected["voice_clone_prompt"]["ref_code"]
        assert REF_CODES_KEY not in outputs["xvector_only"].outputs[0].multimodal_output


@pytest.mark.parametrize("name", ["Base", "Base_0.6B"])
def test_speaker_encoder_matches_qwen_tts(checkpoints, name):
    engine = talker_engine(checkpoints[name])
    audio = torch.tensor(reference_audio(), dtype=torch.float32)
    ours = engine.model.speaker_encoder.embed(audio)
    theirs = torch.tensor(fixture(name)["voice_clone_prompt"]["ref_spk_embedding"])
    assert ours.shape[0] == engine.model.hidden_size  # the talker's width (32 at 0.6B, 64 at 1.7B)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_the_0_6b_shapes_and_its_custom_voice_refuses_instructions(checkpoints):
    """0.6B: a talker narrower than its text embeddings, as wide as its code predictor (no
    small_to_mtp_projection); its CustomVoice model was trained without instructions (qwen-tts
    drops them: we refuse them)."""
    model = talker_engine(checkpoints["CustomVoice_0.6B"]).model
    assert model.code_predictor.small_to_mtp_projection is None
    assert model.config.text_hidden_size > model.hidden_size
    processor = Qwen3TTSInputProcessor(checkpoints["CustomVoice_0.6B"])
    with pytest.raises(ValueError, match="0.6B CustomVoice model takes no instructions"):
        processor.process({"prompt": "Hi.", "speaker": "vivian", "instructions": "Speak slowly."})


def test_seeded_sampling_is_reproducible(checkpoints):
    ckpt = checkpoints["CustomVoice"]
    engine = talker_engine(ckpt)
    processor = Qwen3TTSInputProcessor(ckpt, engine.tokenizer)
    prompt = processor.process(case_prompt("CustomVoice", CASES["CustomVoice"][0]))

    def sampled(seed: int) -> dict:
        return SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05, min_tokens=2,
                              max_tokens=12, seed=seed)

    params = {"a": sampled(1), "b": sampled(1), "c": sampled(2)}
    out = run_talker(engine, {rid: prompt for rid in params}, params)
    codes = {rid: o.outputs[0].multimodal_output[CODES_KEY].tolist() for rid, o in out.items()}
    assert codes["a"] == codes["b"]
    assert codes["a"] != codes["c"]
    greedy_codes = run_talker(engine, {"g": prompt}, {"g": greedy()})["g"].outputs[0].multimodal_output[CODES_KEY]
    assert codes["a"] != greedy_codes.tolist()


def test_streamed_decode_joins_to_the_whole_decode(checkpoints):
    """The streaming path's chunks (4 frames, then each as long as all before it up to 25, with 25 frames of left context)
    join into the audio of one whole decode: the decoder is causal, and 25 frames of context
    cover its receptive field closely (not exactly: the transformer's sliding window spans 8
    frames per layer). A cloned voice's reference frames are decoded but not played."""
    model = Qwen3TTSCode2Wav.load(str(checkpoints["CustomVoice"]))
    decoder, spf = model.decoder, model.decoder.samples_per_frame
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, decoder.codebook_size, (60, decoder.num_quantizers), generator=generator)
    with torch.inference_mode():
        whole = decoder(codes.T[None])[0, 0]
    chunks = audio_of(run_stream(model, open_empty(model), codes, [3, 10, 47]))
    assert [c.numel() // spf for c in chunks] == [4, 4, 8, 16, 25, 3]  # the ramp of code2wav_stream.py
    torch.testing.assert_close(torch.cat(chunks), whole, rtol=0, atol=1e-4)
    cloned = audio_of(run_stream(model, open_empty(model, context_frames=10), codes, [3, 10, 47]))
    torch.testing.assert_close(torch.cat(cloned), whole[10 * spf:], rtol=0, atol=1e-4)
    # The reference is the first chunk's left context, not chunks of its own: first audio comes
    # after the first generated frames, however long the reference.
    assert [c.numel() // spf for c in cloned] == [4, 4, 8, 16, 18]
    stream = open_empty(model, context_frames=10)
    with pytest.raises(ValueError, match="ended inside its 10 reference frames"):
        stream.push(codes[:6], final=True)


def test_tiny_checkpoint_cli_builds_each_task_type(tmp_path):
    from vllm_omni.testing.__main__ import main

    main(["qwen3_tts", str(tmp_path / "vd"), "--task-type", "VoiceDesign"])
    config = json.loads((tmp_path / "vd" / "config.json").read_text())
    assert config["tts_model_type"] == "voice_design" and "speaker_encoder_config" not in config
    assert (tmp_path / "vd" / "speech_tokenizer" / "model.safetensors").is_file()


def test_predictor_frame_function_matches_the_eager_predictor(checkpoints):
    """The function the code predictor's CUDA graphs capture, run eagerly (predictor_frames.py)."""
    check_frame_matches_eager_predictor(talker_engine(checkpoints["CustomVoice"]).model, [5, 17, 40])


def test_a_reference_is_encoded_once_for_every_request_that_clones_it(checkpoints, monkeypatch):
    """Requests with the same reference samples share its encodings (reference_cache.py): both
    encoders run once per distinct reference, the speech encoder only once an in-context request
    asks for codes, and the cloned requests' codes are those of fresh encodings."""
    ckpt = checkpoints["Base"]
    engine = talker_engine(ckpt)
    model = engine.model
    runs = {"speaker": 0, "codes": 0}

    def counted(name, encode):
        def run(audio):
            runs[name] += 1
            return encode(audio)
        return run

    cache = model.reference_cache
    monkeypatch.setattr(cache, "_embed_speaker", counted("speaker", cache._embed_speaker))
    monkeypatch.setattr(cache, "_encode_codes", counted("codes", cache._encode_codes))
    processor = Qwen3TTSInputProcessor(ckpt, engine.tokenizer)
    xvector, icl = (next(c for c in CASES["Base"] if c["name"] == name) for name in ("xvector_only", "icl_clone"))
    other = {**case_prompt("Base", icl), "ref_audio": (0.5 * np.asarray(reference_audio(), dtype=np.float32),
                                                        REF_SAMPLE_RATE)}
    prompts = {"icl": processor.process(case_prompt("Base", icl)),
               "xvector": processor.process(case_prompt("Base", xvector)),  # after codes were cached
               "icl_again": processor.process(case_prompt("Base", icl)),
               "other_voice": processor.process(other)}
    outputs = run_talker(engine, prompts, {rid: greedy() for rid in prompts})
    assert runs == {"speaker": 2, "codes": 2} and len(cache) == 2

    codes = {rid: out.outputs[0].multimodal_output[CODES_KEY].tolist() for rid, out in outputs.items()}
    expected = fixture("Base")["cases"]
    assert codes["xvector"] == expected["xvector_only"]["codes"]
    assert REF_CODES_KEY not in outputs["xvector"].outputs[0].multimodal_output
    assert codes["icl"] == codes["icl_again"] == expected["icl_clone"]["codes"]
    fresh = run_talker(talker_engine(ckpt), {"other_voice": prompts["other_voice"]}, {"other_voice": greedy()})
    assert codes["other_voice"] == fresh["other_voice"].outputs[0].multimodal_output[CODES_KEY].tolist()


@pytest.mark.parametrize("seconds", [1.2, 0.77, 2.03])
def test_padded_references_encode_as_the_reference_alone(checkpoints, seconds):
    """What the reference encoders' CUDA graphs compute (reference_graphs.py), run eagerly: a
    reference padded with noise up to a longer buffer gives the speaker row and Mimi's codes of
    the reference alone, and the same quantizer input on every real frame (the codes of random
    weights barely move; the last frame's latent does when the padding leaks into it)."""
    model = talker_engine(checkpoints["Base"]).model
    speaker, speech = model.speaker_encoder, model.speech_encoder
    assert speech.supports_padding()
    audio = torch.tensor(reference_audio(seconds), dtype=torch.float32)
    n = audio.shape[0]
    buffer = (-(-n // speech.samples_per_frame) + 3) * speech.samples_per_frame
    padded = torch.cat([audio, torch.randn(buffer - n, generator=torch.Generator().manual_seed(0))])

    from vllm_omni.model_executor.models.qwen3_tts.speaker_encoder import HOP, mel_spectrogram

    mel = mel_spectrogram(audio)
    mel_buffer = torch.cat([mel, 5 * torch.randn(buffer // HOP - mel.shape[0], mel.shape[1])])[None]
    with torch.inference_mode():
        row = speaker(mel_buffer, torch.tensor(mel.shape[0]))[0]
    torch.testing.assert_close(row, speaker.embed(audio), rtol=1e-5, atol=1e-5)

    latents = []
    quantize = speech.mimi.quantizer.encode
    speech.mimi.quantizer.encode = lambda x, *a, **k: latents.append(x.clone()) or quantize(x, *a, **k)
    codes = speech.encode(audio)
    padded_codes = speech.encode_padded(padded, torch.tensor(n))
    frames = codes.shape[0]
    assert padded_codes.shape[0] == buffer // speech.samples_per_frame
    assert torch.equal(padded_codes[:frames], codes)
    alone, in_buffer = latents[0], latents[1][..., :frames]
    torch.testing.assert_close(in_buffer, alone, rtol=0, atol=1e-4 * float(alone.abs().max()))
    if seconds == 1.2:
        assert codes.tolist() == fixture("Base")["voice_clone_prompt"]["ref_code"]


@pytest.mark.parametrize("rates", [([8, 5, 4, 3], [2, 2]), ([6, 5, 4, 4], [4]), ([10, 8, 3, 2], [2, 2])],
                         ids=["released", "one-front-upsampler", "wide-first-rate"])
def test_the_vocoder_reads_exactly_its_receptive_field(rates):
    """A chunk's vocoder (speech_decoder.py) starts `vocoder_context_frames` frames before the chunk,
    not at its window's start: the chunk's samples are those of the whole window, and a frame less
    of vocoder context changes them (the field is not overestimated)."""
    from vllm_omni.model_executor.models.qwen3_tts.speech_decoder import SpeechDecoder
    from vllm_omni.testing.tiny_qwen3_tts import DECODER_CONFIG

    torch.manual_seed(0)
    decoder = SpeechDecoder({**DECODER_CONFIG, "upsample_rates": rates[0], "upsampling_ratios": rates[1]}).eval()
    with torch.no_grad():  # weights that carry the signal through every layer
        for p in decoder.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.uniform_(-0.3, 0.3)
    codes = torch.randint(0, decoder.codebook_size, (2, decoder.num_quantizers, 30))
    spf, reach, context = decoder.samples_per_frame, decoder.vocoder_context_frames, 20
    with torch.inference_mode():
        whole = decoder(codes)[:, 0, context * spf:]
        trimmed = decoder(codes, context - reach)[:, 0, reach * spf:]
        short = decoder(codes, context - reach + 1)[:, 0, (reach - 1) * spf:]
    assert 0 < reach < context
    # (not bit for bit everywhere: convolutions over other lengths may round differently, ~1e-6)
    torch.testing.assert_close(trimmed, whole, atol=1e-5, rtol=0)
    assert (short - whole).abs().max() > 1e-4  # (2e-4 at least in these three)
