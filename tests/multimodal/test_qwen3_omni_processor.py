"""Our Qwen3-Omni input processing against transformers' Qwen3OmniMoeProcessor (tiny checkpoint).

The reference is built offline from the folder's pieces (tokenizer, WhisperFeatureExtractor,
Qwen2VLImageProcessorPil at patch 16) plus hf_reference's stub video processor, which hands back
pixel values computed with transformers' video math (torchvision is not installed).
"""

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.multimodal.hf_reference import NEW_OMNI_API, StubVideoProcessor, assert_same, reference_patchify
from tests.multimodal.media_files import audio_bytes, image_bytes, mp4_bytes, sine
from vllm_omni.multimodal.media import load_audio, load_image
from vllm_omni.multimodal.qwen3_omni_processor import (
    Qwen3OmniInputProcessor,
    audio_tokens_for_frames,
    interleave_video_audio,
)
from vllm_omni.multimodal.video import load_video


class Qwen3StubVideoProcessor(StubVideoProcessor):
    patch_size = 16


@pytest.fixture(scope="module")
def q3_dir(tiny_model):
    return tiny_model("qwen3_omni_moe")


@pytest.fixture(scope="module")
def proc(q3_dir):
    return Qwen3OmniInputProcessor.from_pretrained(q3_dir)


@pytest.fixture(scope="module")
def ref(q3_dir):
    from transformers import AutoTokenizer, Qwen3OmniMoeProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pre = json.loads((q3_dir / "preprocessor_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(q3_dir)
    feature_extractor = WhisperFeatureExtractor(
        feature_size=pre["feature_size"], sampling_rate=pre["sampling_rate"], hop_length=pre["hop_length"],
        chunk_length=pre["chunk_length"], n_fft=pre["n_fft"],
    )
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=pre["patch_size"], image_mean=pre["image_mean"], image_std=pre["image_std"],
        min_pixels=pre["min_pixels"], max_pixels=pre["max_pixels"],
    )
    return Qwen3OmniMoeProcessor(
        image_processor=image_processor, video_processor=Qwen3StubVideoProcessor(),
        feature_extractor=feature_extractor, tokenizer=tokenizer, chat_template=tokenizer.chat_template,
    )


def run_ref(ref, messages, images=(), audios=(), video=None, use_audio_in_video=False):
    """`video`: (frames, sample_fps, audio or None), frames sampled and resized by our loader.
    With use_audio_in_video its track follows the standalone `audios` (the tests put the video last)."""
    text = ref.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    kwargs, audio = {}, list(audios)
    if images:
        kwargs["images"] = list(images)
    if video is not None:
        frames, fps, track = video
        ip = ref.image_processor
        ref.video_processor.outputs = [reference_patchify(frames, ip.image_mean, ip.image_std, patch=16)]
        kwargs.update(videos=[frames], fps=fps)
        if use_audio_in_video:
            audio.append(track)
            if NEW_OMNI_API:
                kwargs.update(load_audio_from_video=True, audio_from_video_indices=[None] * len(audios) + [0])
            else:
                kwargs["use_audio_in_video"] = True
    if audio:
        kwargs["audio"] = audio
    return ref(text=text, return_tensors="pt", **kwargs)


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def test_text_only(proc, ref):
    for messages in [
        user({"type": "text", "text": "Hello there"}),
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello!"},
            {"role": "user", "content": [{"type": "text", "text": "Why?"}]},
        ],
    ]:
        ours = proc.process_messages(messages)
        assert_same(ours, run_ref(ref, messages))
        assert ours.mm_inputs == {} and ours.use_audio_in_video is False
    text = proc.tokenizer.decode(proc.process_messages(user("Hi")).prompt_token_ids)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"  # no default system prompt


def test_audio_and_text(proc, ref):
    long_wave = sine(2.3, 16000)[:, 0]  # 230 frames: two full 100-frame chunks + 30
    wav = audio_bytes("WAV", seconds=0.7, sr=22050)
    ours = proc.process_messages(user(
        {"type": "audio", "audio": (long_wave, 16000)},
        {"type": "text", "text": "and"},
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
        {"type": "text", "text": "What are these?"},
    ))
    reference = run_ref(
        ref, user({"type": "audio"}, {"type": "text", "text": "and"}, {"type": "audio"},
                  {"type": "text", "text": "What are these?"}),
        audios=[long_wave, load_audio(wav)],
    )
    assert_same(ours, reference)
    assert ours.mm_inputs["feature_attention_mask"].sum(-1).tolist() == [230, 70]
    audio_id = proc.ids.audio
    assert ours.prompt_token_ids.count(audio_id) == (2 * 13 + 4) + 9  # 13 per full chunk


def test_image_and_text(proc, ref):
    png, jpeg = image_bytes("PNG", (90, 60)), image_bytes("JPEG", (300, 200), seed=1)
    url = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    ours = proc.process_messages(user(
        {"type": "text", "text": "Compare"},
        {"type": "image", "image": Image.open(io.BytesIO(png))},
        {"type": "image_url", "image_url": {"url": url}},
    ))
    reference = run_ref(
        ref, user({"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}),
        images=[load_image(png), load_image(jpeg)],
    )
    assert_same(ours, reference)
    assert ours.mm_inputs["image_grid_thw"].tolist() == [[1, 4, 6], [1, 12, 18]]  # 32-pixel steps
    assert ours.mm_inputs["pixel_values"].shape[-1] == 3 * 2 * 16 * 16


def test_video_and_text(proc, ref):
    data = mp4_bytes(n_frames=25, fps=10, size=(48, 64))
    clip = load_video(data, sampling=proc.video_sampling)
    assert clip.frames.shape[1] % 32 == 0 and clip.frames.shape[2] % 32 == 0
    ours = proc.process_messages(user({"type": "video", "video": data}, "What happens?"))
    reference = run_ref(ref, user({"type": "video"}, {"type": "text", "text": "What happens?"}),
                        video=(clip.frames, clip.sample_fps, None))
    assert_same(ours, reference)


def test_video_with_audio_in_video(proc, ref):
    data = mp4_bytes(n_frames=40, fps=10, size=(48, 64), with_audio=True)
    clip = load_video(data, sampling=proc.video_sampling, with_audio=True)
    standalone = sine(0.9, 16000)[:, 0]
    ours = proc.process_messages(
        user({"type": "audio", "audio": standalone}, {"type": "video", "video": data}, "?"), use_audio_in_video=True
    )
    reference = run_ref(
        ref, user({"type": "audio"}, {"type": "video"}, {"type": "text", "text": "?"}),
        audios=[standalone], video=(clip.frames, clip.sample_fps, clip.audio), use_audio_in_video=True,
    )
    assert_same(ours, reference)
    ids, tok = ours.prompt_token_ids, proc.ids
    start = ids.index(tok.video) - 1  # the video's block: audio_start, merged tokens, audio_end
    block = ids[start + 1 : ids.index(tok.audio_eos, start)]
    assert ids[start] == tok.audio_bos and sum(a != b for a, b in zip(block, block[1:])) >= 3


def test_interleave_ties_and_leftovers():
    from vllm_omni.multimodal.qwen2_5_omni_placeholders import OmniTokenIds

    ids = OmniTokenIds(audio=1, image=2, video=3, audio_bos=4, audio_eos=5)
    # frame groups at 0, 2, 4 position ids (1 token each): a video token wins a tie
    out = interleave_video_audio(ids, [3, 2, 2], 2, 0.25, 3, 8)
    assert out == [4, 3, 1, 1, 3, 1, 3, 5]
    assert interleave_video_audio(ids, [1, 2, 2], 2, 1.0, 0) == [4, 3, 5]


@pytest.mark.parametrize("frames", [1, 99, 100, 101, 230, 3000])
def test_audio_token_formula_matches_transformers(frames):
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    assert audio_tokens_for_frames(frames) == int(_get_feat_extract_output_lengths(torch.tensor(frames)))


def test_plain_prompt_path_and_errors(proc):
    wave, image = sine(0.5, 16000)[:, 0], load_image(image_bytes())
    messages = user({"type": "image", "image": image}, {"type": "audio", "audio": wave}, "Describe.")
    expected = proc.process_messages(messages)
    prompt = proc.tokenizer.apply_chat_template(
        user({"type": "image"}, {"type": "audio"}, {"type": "text", "text": "Describe."}),
        tokenize=False, add_generation_prompt=True,
    )
    assert "<|audio_start|><|audio_pad|><|audio_end|>" in prompt
    got = proc.process_prompt(prompt, {"image": image, "audio": [wave]})
    assert got.prompt_token_ids == expected.prompt_token_ids
    for key, value in expected.mm_inputs.items():
        torch.testing.assert_close(got.mm_inputs[key], value)
    with pytest.raises(ValueError, match="1 audio placeholder"):
        proc.process_prompt("<|audio_start|><|audio_pad|><|audio_end|>", {})
    with pytest.raises(ValueError, match="too short"):
        proc.process_messages(user({"type": "audio", "audio": np.zeros(100, np.float32)}))


def test_tokenizer_without_token_names(q3_dir):
    """A tokenizer saved without `audio_token` & co. gets the released Qwen3 names (the base
    class would otherwise look for Qwen2.5's <|AUDIO|>)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(q3_dir)
    for attr in ["audio_token", "image_token", "video_token", "audio_bos_token", "audio_eos_token"]:
        setattr(tokenizer, attr, None)
    ids = Qwen3OmniInputProcessor.from_pretrained(q3_dir, tokenizer=tokenizer).ids
    want = tokenizer.convert_tokens_to_ids(["<|audio_pad|>", "<|image_pad|>", "<|video_pad|>", "<|audio_start|>"])
    assert [ids.audio, ids.image, ids.video, ids.audio_bos] == want
