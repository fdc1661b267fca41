"""Qwen3-TTS through the whole pipeline (bundled configs, stages as threads) against qwen-tts:
`Omni(model).generate` and `vllm-omni generate` speak exactly what qwen-tts speaks (greedy; the
reference waveforms of tests/reference/qwen_tts/fixtures), and refuse bad voices before any
stage runs."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import in_threads
from tests.models.test_qwen3_tts import CASES, MAX_NEW_TOKENS, REFERENCE, SEED, WAVE_ATOL, case_prompt
from vllm_omni import Omni
from vllm_omni.entrypoints.cli.main import main

# qwen-tts' greedy settings (see test_qwen3_tts.greedy), as per-stage overrides.
GREEDY = [{"temperature": 0.0, "max_tokens": MAX_NEW_TOKENS - 1, "repetition_penalty": 1.05, "min_tokens": 2}, None]
BATCH_4 = in_threads(2, {"0": {"max_num_seqs": 4}, "1": {"max_num_seqs": 4}})


def reference_wave(task: str, name: str) -> np.ndarray:
    return np.load(REFERENCE / "fixtures" / f"{task}_waveforms.npz")[name]


@pytest.fixture(scope="module")
def custom_voice(tiny_model):
    return tiny_model("qwen3_tts", seed=SEED, task_type="CustomVoice")


def test_omni_generate_speaks_like_qwen_tts(custom_voice):
    cases = CASES["CustomVoice"]
    with Omni(model=str(custom_voice), stage_overrides=BATCH_4) as omni:
        outputs = omni.generate([case_prompt("CustomVoice", c) for c in cases], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=r"unknown voice 'nobody'; available voices: \['eric', 'ryan', 'vivian'\]"):
            omni.generate([{"prompt": "Hi", "speaker": "nobody"}], use_tqdm=False)
    assert len(outputs) == len(cases)
    order = {}
    for out in outputs:  # one audio output per request, in completion order
        assert out.error is None and out.final_output_type == "audio"
        order[out.request_id] = out.request_output.outputs[0].multimodal_output
    for case, produced in zip(cases, [order[k] for k in sorted(order, key=int)]):
        assert int(produced["sample_rate"]) == 24000
        np.testing.assert_allclose(produced["audio"].numpy(), reference_wave("CustomVoice", case["name"]),
                                   rtol=0, atol=WAVE_ATOL, err_msg=case["name"])


def test_cli_generate_writes_the_wav(custom_voice, tmp_path, capsys):
    case = CASES["CustomVoice"][1]  # with instructions and a language
    out_dir = tmp_path / "out"
    argv = ["generate", str(custom_voice), "--prompt", case["text"], "--speaker", case["speaker"],
            "--instructions", case["instruct"], "--language", case["language"], "--temperature", "0",
            "--max-tokens", str(MAX_NEW_TOKENS - 1), "--output-dir", str(out_dir),
            "--stage-overrides", json.dumps(in_threads(2))]
    assert main(argv) == 0, capsys.readouterr().out
    wave, rate = sf.read(out_dir / "reply_0.wav", dtype="float32")
    assert rate == 24000
    reference = reference_wave("CustomVoice", case["name"])
    assert wave.shape == reference.shape
    # The file holds 16-bit PCM: within one quantization step of qwen-tts' float waveform.
    assert np.abs(wave - reference).max() <= 1.5 / 32768


def test_streaming_edge_starts_code2wav_early_and_changes_nothing(custom_voice):
    """The bundled deploy config streams the talker's frames to code2wav (async_chunk): code2wav
    starts every request before the talker ends it, and the audio and its codes are those of
    handing over finished requests (up to the chunked decode's 25-frame context)."""
    cases = CASES["CustomVoice"]
    prompts = [case_prompt("CustomVoice", c) for c in cases]
    results = {}
    for streaming in (False, True):
        with Omni(model=str(custom_voice), stage_overrides=BATCH_4, async_chunk=streaming) as omni:
            outs = omni.generate(prompts, GREEDY, use_tqdm=False)
            early = omni._runtime.orchestrator.stage_counters[1].get("early_starts", 0)
        assert early == (len(cases) if streaming else 0)
        results[streaming] = {o.request_id: o.request_output for o in outs}
    for rid, whole in results[False].items():
        streamed = results[True][rid]
        assert streamed.prompt_token_ids == whole.prompt_token_ids, rid
        np.testing.assert_allclose(streamed.outputs[0].multimodal_output["audio"].numpy(),
                                   whole.outputs[0].multimodal_output["audio"].numpy(), rtol=0, atol=1e-4, err_msg=rid)


def test_stages_as_threads_speak_like_qwen_tts(custom_voice):
    """Both stages as threads of this process (`runtime.process: false`), the streaming edge of
    the bundled deploy config: the same waveforms as qwen-tts, as the stage processes above give
    them (tests/gpu/test_in_process_stages.py compares threads with processes on the GPU)."""
    cases = CASES["CustomVoice"]
    overrides = {stage: {"process": False, "max_num_seqs": 4} for stage in "01"}
    with Omni(model=str(custom_voice), stage_overrides=overrides) as omni:
        assert {h.pid for h in omni.stage_health()} == {os.getpid()}
        outputs = omni.generate([case_prompt("CustomVoice", c) for c in cases], GREEDY, use_tqdm=False)
        assert omni._runtime.orchestrator.stage_counters[1]["early_starts"] == len(cases)
    audio = {int(o.request_id): o.request_output.outputs[0].multimodal_output["audio"] for o in outputs}
    assert all(o.error is None for o in outputs) and sorted(audio) == list(range(len(cases)))
    for i, case in enumerate(cases):
        np.testing.assert_allclose(audio[i].numpy(), reference_wave("CustomVoice", case["name"]), rtol=0,
                                   atol=WAVE_ATOL, err_msg=case["name"])
