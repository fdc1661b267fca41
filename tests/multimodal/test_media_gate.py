"""The media gate and the decode limits, without a server: data-URL types, local-file rules that
tell nothing about files outside the root, one source per part, and decoders that stop at
their limit while decoding (a small FLAC of hours of silence, a PNG whose header promises more
pixels than allowed, a video over its pixel budget)."""
from __future__ import annotations

import base64
import time
import tracemalloc
from dataclasses import replace

import pytest

from tests.multimodal.media_files import audio_bytes, flac_bomb, image_bytes, mp4_bytes, png_bomb
from vllm_omni.multimodal.chat_parts import classify_part
from vllm_omni.multimodal.media import TRUSTED, load_audio, load_image
from vllm_omni.multimodal.media_fetch import fetch_blocking
from vllm_omni.multimodal.media_policy import DecodeLimits, MediaBudget, MediaError, MediaPolicy
from vllm_omni.multimodal.video import load_video


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def limited(**limits) -> MediaPolicy:
    return replace(TRUSTED, limits=DecodeLimits(**limits))


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return flac_bomb(hours=1.0)


def test_a_data_url_must_be_of_its_parts_kind():
    png, wav = image_bytes("PNG"), audio_bytes("WAV")
    with pytest.raises(MediaError, match="'audio/wav' cannot be image media"):
        load_image(data_url(png, "audio/wav"))
    with pytest.raises(MediaError, match="'image/png' cannot be audio media"):
        load_audio(data_url(wav, "image/png"))
    assert load_image(data_url(png, "image/png")).size == (90, 60)
    assert load_image("data:;base64," + base64.b64encode(png).decode()).size == (90, 60)  # no type: no claim


def test_a_data_url_over_the_byte_limit_is_refused_before_decoding():
    with pytest.raises(MediaError, match="--max-media-bytes"):
        fetch_blocking(data_url(b"\0" * 3000, "image/png"), "image", replace(TRUSTED, max_bytes=1000))


def test_refused_local_paths_get_one_answer_whether_or_not_they_exist(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(image_bytes())
    (tmp_path / "secret.png").write_bytes(image_bytes())
    policy = MediaPolicy(allowed_local_root=root)
    answers = set()
    for path in (tmp_path / "secret.png", tmp_path / "missing.png"):
        for source in (str(path), f"file://{path}"):
            with pytest.raises(MediaError) as e:
                fetch_blocking(source, "image", policy)
            answers.add(str(e.value).replace("file://", "").replace("secret", "X").replace("missing", "X"))
    assert len(answers) == 1 and "outside --allowed-local-media-path" in answers.pop()
    assert fetch_blocking(str(root / "ok.png"), "image", policy) == root / "ok.png"
    with pytest.raises(MediaError, match="local media files are not allowed"):
        fetch_blocking("/etc/passwd", "image", MediaPolicy())


def test_a_part_has_exactly_one_source_and_no_unknown_keys():
    url = {"url": "data:image/png;base64,AAAA"}
    with pytest.raises(MediaError, match="2 sources"):
        classify_part({"type": "image_url", "image_url": url, "image": "http://127.0.0.1/x.png"})
    with pytest.raises(MediaError, match="2 sources"):
        classify_part({"type": "image", "image": "/etc/passwd", "path": "/etc/hosts"})
    with pytest.raises(MediaError, match=r"unknown key\(s\) \['source'\]"):
        classify_part({"type": "audio_url", "audio_url": url, "source": "/etc/passwd"})
    assert classify_part({"type": "image_url", "image_url": url, "max_pixels": 9000}).options == {"max_pixels": 9000}


def test_the_request_budget_counts_items_and_bytes():
    budget = MediaBudget(MediaPolicy(max_items=2, max_total_bytes=100))
    budget.take_item()
    budget.take_item()
    with pytest.raises(MediaError, match="--max-media-items"):
        budget.take_item()
    budget.take_bytes(100)
    with pytest.raises(MediaError, match="--max-media-total-bytes"):
        budget.take_bytes(1)


def test_audio_decoding_stops_at_the_duration_limit(bomb):
    """An hour of audio in a small FLAC: refused once 60 s are decoded, never held whole (an
    hour at 8 kHz is 115 MB of float32)."""
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(MediaError, match="longer than 60 s"):
            load_audio(bomb, limited(max_audio_s=60))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20e6, peak
    assert time.monotonic() - started < 10
    assert load_audio(audio_bytes("FLAC", seconds=1.0), limited(max_audio_s=60)).size == 16000


def test_the_audio_track_of_a_video_is_bounded_too():
    with pytest.raises(MediaError, match="--max-audio-duration"):
        load_audio(mp4_bytes(n_frames=8, fps=4, with_audio=True), limited(max_audio_s=0.5))


def test_an_image_is_refused_from_its_header():
    """The header says 6000x6000: refused before any pixel is decoded (a truncated body proves
    nothing was read past the header)."""
    bomb = png_bomb(6000, 6000)
    with pytest.raises(MediaError, match=r"6000x6000 \(36000000 pixels\).*--max-image-pixels"):
        load_image(bomb)  # the default limit: 32 Mi pixels
    with pytest.raises(MediaError, match="--max-image-pixels"):
        load_image(bomb[:200], limited(max_image_pixels=1000))
    assert load_image(png_bomb(64, 48), limited(max_image_pixels=64 * 48)).size == (64, 48)


def test_video_frames_and_decoding_are_bounded():
    mp4 = mp4_bytes(n_frames=8, fps=4)
    frame = load_video(mp4).frames
    assert frame.shape[0] == 4  # decodes within the defaults
    with pytest.raises(MediaError, match="a video frame is .*--max-image-pixels"):
        load_video(mp4, limited(max_image_pixels=100))
    with pytest.raises(MediaError, match="--max-video-pixels"):
        load_video(mp4, limited(max_video_pixels=5 * 64 * 64))
    with pytest.raises(MediaError, match="--max-video-pixels"):  # a video given as its frames
        load_video([image_bytes()] * 4, limited(max_video_pixels=3 * 90 * 60))


def test_a_request_cannot_ask_for_larger_images_than_the_limit(tiny_model):
    from vllm_omni.multimodal.qwen2_5_omni_processor import Qwen2_5OmniInputProcessor

    proc = Qwen2_5OmniInputProcessor.from_pretrained(tiny_model("qwen2_5_omni"), media=limited(max_image_pixels=10**6))
    image = {"type": "image_url", "image_url": {"url": data_url(image_bytes(), "image/png")}}
    with pytest.raises(MediaError, match="min_pixels=4000000 is over the 1000000 pixel limit"):
        proc.process_messages([{"role": "user", "content": [{**image, "min_pixels": 4 * 10**6}]}])
    video = {"type": "video_url", "video_url": {"url": data_url(mp4_bytes(n_frames=8, fps=4), "video/mp4")},
             "max_pixels": 2 * 10**6}
    with pytest.raises(MediaError, match="max_pixels=2000000 is over"):
        proc.process_messages([{"role": "user", "content": [video]}])


def test_a_video_given_as_frame_urls_counts_each_frame_as_an_item():
    png = data_url(image_bytes(), "image/png")
    with pytest.raises(MediaError, match="--max-media-items"):
        load_video([png] * 5, replace(TRUSTED, max_items=4))
    assert load_video([png] * 4, replace(TRUSTED, max_items=4)).frames.shape[0] == 4
