"""Our Qwen2.5-Omni input processing against transformers' Qwen2_5OmniProcessor (tiny checkpoint)."""

import base64

import numpy as np
import pytest
import torch
from PIL import Image

from tests.multimodal.hf_reference import assert_same, make_reference, reference_patchify, run_reference
from tests.multimodal.media_files import audio_bytes, image_bytes, mp4_bytes, sine
from vllm_omni.multimodal.media import load_audio, load_image
from vllm_omni.multimodal.qwen2_5_omni_placeholders import whisper_features
from vllm_omni.multimodal.video import load_video
from vllm_omni.multimodal.vision import patchify_video


@pytest.fixture(scope="module")
def ref(omni_dir):
    return make_reference(omni_dir)


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def test_text_only(omni_processor, ref):
    for messages in [
        user({"type": "text", "text": "Hello there"}),
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": [{"type": "text", "text": "Why?"}]},
        ],
    ]:
        ours = omni_processor.process_messages(messages)
        assert_same(ours, run_reference(ref, messages))
        assert ours.mm_inputs == {} and ours.use_audio_in_video is False
    text = omni_processor.tokenizer.decode(omni_processor.process_messages(user("Hi")).prompt_token_ids)
    assert text.startswith("<|im_start|>system\nYou are Qwen, a virtual human")


def test_audio_and_text(omni_processor, ref):
    long_wave = sine(1.3, 16000)[:, 0]
    wav = audio_bytes("WAV", seconds=0.7, sr=22050)
    ours = omni_processor.process_messages(user(
        {"type": "audio", "audio": (long_wave, 16000)},
        {"type": "text", "text": "and"},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
        {"type": "text", "text": "What are these?"},
    ))
    reference = run_reference(
        ref, user({"type": "audio"}, {"type": "text", "text": "and"}, {"type": "audio"},
                  {"type": "text", "text": "What are these?"}),
        audios=[long_wave, load_audio(wav)],
    )
    assert_same(ours, reference)
    assert ours.mm_inputs["input_features"].shape[-1] == 130  # only the unmasked frames


def test_image_and_text(omni_processor, ref):
    png, jpeg = image_bytes("PNG", (90, 60)), image_bytes("JPEG", (300, 200), seed=1)
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    ours = omni_processor.process_messages(user(
        {"type": "text", "text": "Compare"},
        {"type": "image", "image": Image.open(__import__("io").BytesIO(png))},
        {"type": "image_url", "image_url": {"url": url}},
    ))
    reference = run_reference(
        ref, user({"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}),
        images=[load_image(png), load_image(jpeg)],
    )
    assert_same(ours, reference)
    assert ours.mm_inputs["image_grid_thw"].tolist() == [[1, 4, 6], [1, 14, 22]]


def test_image_pixel_options(omni_processor):
    image = load_image(image_bytes("PNG", (300, 200)))
    ours = omni_processor.process_messages(user({"type": "image", "image": image, "max_pixels": 28 * 28 * 4}))
    want = omni_processor.image_processor(
        images=[image], size={"shortest_edge": 3136, "longest_edge": 28 * 28 * 4}, return_tensors="pt"
    )
    torch.testing.assert_close(ours.mm_inputs["pixel_values"], want["pixel_values"])
    assert ours.mm_inputs["image_grid_thw"].tolist() == want["image_grid_thw"].tolist() == [[1, 2, 4]]


def test_video_and_text(omni_processor, ref):
    data = mp4_bytes(n_frames=25, fps=10, size=(48, 64))
    clip = load_video(data)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    ours = omni_processor.process_messages(user({"type": "video_url", "video_url": {"url": url}}, "What happens?"))
    reference = run_reference(ref, user({"type": "video"}, {"type": "text", "text": "What happens?"}),
                              videos=[(clip.frames, clip.sample_fps, None)])
    assert_same(ours, reference)
    assert ours.mm_inputs["video_second_per_grid"].tolist() == [2 / 1.6]


def test_video_with_audio_in_video(omni_processor, ref):
    data = mp4_bytes(n_frames=40, fps=10, size=(48, 64), with_audio=True)  # 4 s: two 2 s chunks
    clip = load_video(data, with_audio=True)
    standalone = sine(0.9, 16000)[:, 0]
    parts = [{"type": "audio", "audio": standalone}, {"type": "video", "video": data}, "?"]
    ours = omni_processor.process_messages(user(*parts), use_audio_in_video=True)
    reference = run_reference(
        ref, user({"type": "audio"}, {"type": "video"}, {"type": "text", "text": "?"}),
        audios=[standalone], videos=[(clip.frames, clip.sample_fps, clip.audio)], use_audio_in_video=True,
    )
    assert_same(ours, reference)
    assert ours.use_audio_in_video
    ids, tok = ours.prompt_token_ids, omni_processor.ids
    # the video's block: audio_bos, then video and audio tokens alternate chunk by chunk
    start = ids.index(tok.video) - 1
    assert ids[start] == tok.audio_bos
    block = ids[start + 1 : ids.index(tok.audio_eos, start)]
    switches = sum(1 for a, b in zip(block, block[1:]) if a != b)
    assert switches >= 3, switches


def test_patchify_matches_transformers():
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (5, 56, 84, 3), dtype=np.uint8)  # odd count: last frame repeats
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    ours, grid = patchify_video(frames, mean, std)
    want, want_grid = reference_patchify(frames, mean, std)
    assert grid == want_grid == [3, 4, 6]
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=0)
    # Two identical frames are one image to transformers' (PIL) image processor.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = Qwen2VLImageProcessorPil(image_mean=mean, image_std=std)(images=[frames[0]], return_tensors="pt")
    ours, grid = patchify_video(frames[[0, 0]], mean, std)
    torch.testing.assert_close(ours, image["pixel_values"], atol=1e-5, rtol=0)
    assert [grid] == image["image_grid_thw"].tolist()


@pytest.mark.parametrize("n", [1000, 15999, 16000, 16100, 20000])
def test_whisper_features_match_max_length_padding(n):
    """Kept frames equal the reference's (padding to the maximum) near and past the limit:
    a 1 s maximum here stands for the model's 300 s."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128, chunk_length=1)
    wave = np.random.default_rng(n).normal(0, 0.1, n).astype(np.float32)
    ours, mask = whisper_features(fe, [wave])
    ref = fe([wave], sampling_rate=16000, padding="max_length", return_attention_mask=True,
             return_tensors="pt")
    kept = int(mask.sum())
    assert kept == int(ref["attention_mask"].sum()) == min(-(-n // 160), 100)
    torch.testing.assert_close(ours[0, :, :kept], ref["input_features"][0, :, :kept], atol=1e-5, rtol=0)


def test_plain_prompt_path(omni_processor):
    wave, image = sine(0.5, 16000)[:, 0], load_image(image_bytes())
    messages = user({"type": "image", "image": image}, {"type": "audio", "audio": wave}, "Describe.")
    expected = omni_processor.process_messages(messages)
    prompt = omni_processor.tokenizer.apply_chat_template(
        user({"type": "image"}, {"type": "audio"}, {"type": "text", "text": "Describe."}),
        tokenize=False, add_generation_prompt=True,
    )
    got = omni_processor.process_prompt(prompt, {"image": image, "audio": [wave]})
    assert got.prompt_token_ids == expected.prompt_token_ids
    for key, value in expected.mm_inputs.items():
        torch.testing.assert_close(got.mm_inputs[key], value)
    ids = omni_processor.tokenizer("<|im_start|>user\nHi<|im_end|>\n")["input_ids"]
    assert omni_processor.process_prompt(ids).prompt_token_ids == ids  # text only, as ids


def test_errors(omni_processor):
    wave = sine(0.5, 16000)[:, 0]
    with pytest.raises(ValueError, match="1 audio placeholder"):
        omni_processor.process_prompt("<|audio_bos|><|AUDIO|><|audio_eos|>", {})
    with pytest.raises(ValueError, match="0 image placeholder"):
        omni_processor.process_prompt("hi", {"image": [load_image(image_bytes())]})
    silent_video = user({"type": "video", "video": mp4_bytes()})
    with pytest.raises(ValueError, match="no audio track"):
        omni_processor.process_messages(silent_video, use_audio_in_video=True)
    with pytest.raises(ValueError, match="unsupported content part type"):
        omni_processor.process_messages(user({"type": "hologram", "hologram": 1}))
    with pytest.raises(ValueError, match="invalid base64"):
        omni_processor.process_messages(user({"type": "input_audio", "input_audio": {"data": "%%", "format": "wav"}}))
    with pytest.raises(ValueError, match="has no data"):
        omni_processor.process_messages(user({"type": "image_url"}))
    with pytest.raises(ValueError, match="too short"):
        omni_processor.process_messages(user({"type": "audio", "audio": wave[:100]}))
    with pytest.raises(ValueError, match="unknown video option"):
        omni_processor.process_messages(silent_video, video_options={"fsp": 1})


def test_thinker_outputs_match_with_reference_inputs(omni_dir, omni_processor, ref):
    """The tiny model generates the same tokens from our inputs as from transformers' (so the
    unmasked-frames-only audio features lose nothing), for every modality at once."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir).eval()
    data = mp4_bytes(n_frames=20, fps=10, size=(48, 64), with_audio=True)
    clip = load_video(data, with_audio=True)
    image, wave = load_image(image_bytes()), sine(0.8, 16000)[:, 0]
    ours = omni_processor.process_messages(
        user({"type": "image", "image": image}, {"type": "audio", "audio": wave},
             {"type": "video", "video": data}, "Describe all of it."),
        use_audio_in_video=True,
    )
    reference = run_reference(
        ref, user({"type": "image"}, {"type": "audio"}, {"type": "video"}, {"type": "text", "text": "Describe all of it."}),
        images=[image], audios=[wave], videos=[(clip.frames, clip.sample_fps, clip.audio)],
        use_audio_in_video=True,
    )
    ref_mm = {k: v for k, v in reference.items() if k not in ("input_ids", "attention_mask")}
    outputs = []
    for ids, mm in [(torch.tensor([ours.prompt_token_ids]), ours.mm_inputs), (reference["input_ids"], ref_mm)]:
        out = model.thinker.generate(
            input_ids=ids, **mm, use_audio_in_video=True, max_new_tokens=8, do_sample=False, eos_token_id=None
        )
        outputs.append(out[0, ids.shape[1]:].tolist())
    assert outputs[0] == outputs[1]
    assert len(set(outputs[0])) >= 4, outputs[0]
