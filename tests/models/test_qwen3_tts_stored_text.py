"""Qwen3-TTS talker inputs that do not come whole with the request (CPU, float32):

- a stored voice (voice_encoder.py): the speaker row and reference codes encoded once, outside
  the talker, give exactly the codes of the same reference passed inline;
- text that streams in (text_feed.py): chunks appended while the request runs give exactly the
  codes of the whole text read one token per frame (qwen-tts' streaming layout), however the
  chunks arrive, as long as the talker waits for text (max_frames_per_token 0); with a budget
  it goes on with tts_pad rows while it waits, then reads the text that comes.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from vllm_omni.model_executor.models.qwen3_tts.text_feed import TextFeed
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.model_executor.models.qwen3_tts.tts_request import CODES_KEY, REF_CODES_KEY
from vllm_omni.model_executor.models.qwen3_tts.voice_encoder import VoiceEncoder, voice_fingerprint
from vllm_omni.multimodal.qwen3_tts_input import Qwen3TTSInputProcessor, load_reference_audio
from tests.models.test_qwen3_tts import (
    CASES, REF_SAMPLE_RATE, SEED, case_prompt, greedy, reference_audio, run_talker, talker_engine,
)

TEXT = ["A journey of a thousand miles", " begins with a single step.", " Then another one,", " and more."]
WORDS = re.findall(r"\s*\S+", "".join(TEXT))


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model("qwen3_tts", seed=SEED, task_type="Base")


def codes_of(out) -> list:
    return out.outputs[0].multimodal_output[CODES_KEY].tolist()


def test_a_stored_voice_speaks_as_its_reference_inline(base):
    engine = talker_engine(base)
    processor = Qwen3TTSInputProcessor(base, engine.tokenizer)
    icl, xvector = (next(c for c in CASES["Base"] if c["name"] == n) for n in ("icl_clone", "xvector_only"))
    audio = load_reference_audio((np.asarray(reference_audio(), dtype=np.float32), REF_SAMPLE_RATE))
    encoder = VoiceEncoder.load(base)
    stored = encoder.encode(audio, icl["ref_text"])
    stored_xvector = encoder.encode(audio, None)
    assert stored_xvector.codes is None and torch.equal(stored_xvector.speaker, stored.speaker)

    def without_reference(case: dict) -> dict:
        return {k: v for k, v in case_prompt("Base", case).items() if k not in ("ref_audio", "ref_text")}

    prompts = {"inline": processor.process(case_prompt("Base", icl)),
               "stored": processor.process({**without_reference(icl), "cloned_voice": stored}),
               "inline_xvector": processor.process(case_prompt("Base", xvector)),
               "stored_xvector": processor.process({**without_reference(xvector), "cloned_voice": stored_xvector}),
               "stored_as_xvector": processor.process({**without_reference(xvector), "cloned_voice": stored})}
    out = run_talker(engine, prompts, {rid: greedy() for rid in prompts})
    assert codes_of(out["stored"]) == codes_of(out["inline"])
    ref = out["inline"].outputs[0].multimodal_output[REF_CODES_KEY]
    assert torch.equal(out["stored"].outputs[0].multimodal_output[REF_CODES_KEY], ref)
    assert codes_of(out["stored_xvector"]) == codes_of(out["inline_xvector"]) == codes_of(out["stored_as_xvector"])
    assert codes_of(out["stored"]) != codes_of(out["stored_xvector"])
    # The talker encoded nothing for the stored voices: only the two inline references.
    assert len(engine.model.reference_cache) == 1


def test_the_fingerprint_follows_the_encoders_weights(base, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    assert voice_fingerprint(copy) == voice_fingerprint(base)
    weights = load_file(str(copy / "model.safetensors"))
    weights["talker.codec_head.weight"] += 1  # the talker is not part of a voice
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert voice_fingerprint(copy) == voice_fingerprint(base)
    name = next(k for k in weights if k.startswith("speaker_encoder."))
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert voice_fingerprint(copy) != voice_fingerprint(base)


def long_greedy() -> SamplingParams:
    """Greedy for 48 frames: longer than the text's tokens, so the talker reads all of it."""
    return SamplingParams(temperature=0.0, max_tokens=48, repetition_penalty=1.05, min_tokens=2)


def streamed(engine, processor, prompt: dict, chunks: list[str], steps_between: int, per_token: float = 0.0):
    """The talker request of chunks[0], the others appended every `steps_between` steps
    (the last one final), run to the end."""
    first = processor.process({**prompt, "prompt": chunks[0], "text_complete": False,
                               "max_frames_per_token": per_token})
    assert engine.add_request("s", first["prompt_token_ids"], long_greedy(),
                              model_inputs=first["additional_information"], input_complete=False) is None
    rest, done = list(chunks[1:]), None
    for step in range(1, 500):
        outs = [o for o in engine.step() if o.finished]
        if outs:
            return outs[0]
        if step % steps_between == 0 and rest:
            text = rest.pop(0)
            engine.append_inputs("s", processor.process_delta({"prompt": text}), final=not rest)
    raise AssertionError(f"the streamed request did not finish ({done})")


@pytest.mark.parametrize("chunks, steps_between", [(TEXT, 1), (WORDS, 5)], ids=["phrases-ahead", "words-behind"])
def test_streamed_text_speaks_as_the_whole_text(tiny_model, chunks, steps_between):
    """Phrases that stay ahead of the talker, and words it catches up with (a word every 5
    frames: it reads one a frame, then waits)."""
    ckpt = tiny_model("qwen3_tts", seed=SEED, task_type="CustomVoice")
    engine = talker_engine(ckpt)
    processor = Qwen3TTSInputProcessor(ckpt, engine.tokenizer)
    ids = [processor.count_tokens(t) for t in chunks]
    assert sum(ids) == processor.count_tokens("".join(TEXT)) < 46  # they split where the tokens split
    prompt = {"speaker": "vivian", "language": "english", "non_streaming_mode": False}
    whole = run_talker(engine, {"w": processor.process({**prompt, "prompt": "".join(TEXT)})}, {"w": long_greedy()})["w"]
    out = streamed(engine, processor, prompt, chunks, steps_between)
    assert len(codes_of(whole)) == 48 and codes_of(out) == codes_of(whole)
    padded = streamed(engine, processor, prompt, chunks, steps_between, per_token=4.0)
    assert (codes_of(padded) == codes_of(whole)) == (steps_between == 1)  # pads while it waits: other speech


def test_streamed_text_with_a_stored_voice_cloned_in_context(base):
    engine = talker_engine(base)
    processor = Qwen3TTSInputProcessor(base, engine.tokenizer)
    audio = load_reference_audio((np.asarray(reference_audio(), dtype=np.float32), REF_SAMPLE_RATE))
    voice = VoiceEncoder.load(base).encode(audio, "Hi.")
    options = {"cloned_voice": voice, "language": "english"}
    needed = processor.streamed_start_tokens(options)
    assert needed > 1  # the text must reach past the reference's frames before the talker starts
    text = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen."
    words = text.split(" ")
    head = next(" ".join(words[:n]) for n in range(1, len(words)) if processor.count_tokens(" ".join(words[:n])) >= needed)
    with pytest.raises(ValueError, match="streamed text needs"):
        processor.process({**options, "prompt": words[0], "text_complete": False})
    whole = run_talker(engine, {"w": processor.process({**options, "prompt": text})}, {"w": long_greedy()})["w"]
    out = streamed(engine, processor, options, [head, text[len(head):]], 3)
    assert codes_of(out) == codes_of(whole)


def test_a_talker_that_runs_out_of_text_goes_on_with_pads_within_its_budget():
    rows = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    pad, eos = torch.full((2,), -1.0), torch.full((2,), -2.0)
    feed = TextFeed(rows[:2], pad, complete=False, text_read=1, max_frames_per_token=2.0)
    assert feed.decidable() == 6  # 2 unread rows; 3 tokens read by then: 6 frames
    assert [feed.row(k).tolist() for k in range(6)] == [rows[0].tolist(), rows[1].tolist()] + [pad.tolist()] * 4
    assert feed.decidable() == 6 and not feed.can_read(6)
    feed.append(rows[2:4], final=False, eos=eos)
    assert feed.decidable() == 10  # frames 6 and 7 read the new rows; 5 tokens: 10 frames
    assert feed.row(6).tolist() == rows[2].tolist() and feed.row(7).tolist() == rows[3].tolist()
    feed.append(rows[4:], final=True, eos=eos)
    assert feed.decidable() is None
    # (frames 8 and 9 were not chosen before the text came: they read it)
    assert [feed.row(k).tolist() for k in (8, 9, 10, 11)] == [rows[4].tolist(), rows[5].tolist(), eos.tolist(),
                                                               pad.tolist()]
    waiting = TextFeed(rows[:1], pad, complete=False, text_read=1)
    assert waiting.decidable() == 1 and waiting.row(0).tolist() == rows[0].tolist() and not waiting.can_read(1)
