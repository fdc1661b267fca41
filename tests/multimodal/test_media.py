"""Media loading: images, audio and video from objects, bytes, data URLs, files and http."""

import base64
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import soundfile as sf
import soxr
from PIL import Image

from tests.multimodal.media_files import audio_bytes, image_bytes, m4a_bytes, mp4_bytes, sine
from vllm_omni.multimodal.media import TRUSTED, MediaPolicy, load_audio, load_image
from vllm_omni.multimodal.video import load_video
from vllm_omni.multimodal.vision import VideoSampling


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


# ------------------------------------------------------------------------------ images


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_image_sources_agree(tmp_path, fmt):
    data = image_bytes(fmt)
    path = tmp_path / f"x.{fmt.lower()}"
    path.write_bytes(data)
    expected = np.asarray(Image.open(path).convert("RGB"))
    for source in [data, data_url(data, f"image/{fmt.lower()}"), str(path), path, f"file://{path}",
                   Image.open(path)]:
        image = load_image(source)
        assert image.mode == "RGB" and image.size == (90, 60)
        assert np.array_equal(np.asarray(image), expected)


def test_rgba_is_composited_on_white():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    assert np.asarray(load_image(rgba))[0, 0].tolist() == [255, 255, 255]


@pytest.mark.parametrize("bad", [b"not an image", image_bytes("PNG")[:100]])
def test_undecodable_image(bad):
    with pytest.raises(ValueError, match="cannot decode image"):
        load_image(bad)


def test_bad_sources():
    with pytest.raises(ValueError, match="invalid base64"):
        load_image("data:image/png;base64,@@@not-base64@@@")
    with pytest.raises(ValueError, match="no such media file"):
        load_image("/nonexistent/x.png")
    with pytest.raises(ValueError, match="scheme"):
        load_image("ftp://host/x.png")
    with pytest.raises(ValueError, match="unsupported media source"):
        load_image(12345)
    with pytest.raises(ValueError, match="not a URL, data URL or readable file"):
        load_image(base64.b64encode(image_bytes()).decode())  # base64 without its data: prefix


def test_local_files_policy(tmp_path):
    path = tmp_path / "x.png"
    path.write_bytes(image_bytes())
    with pytest.raises(ValueError, match="not allowed"):
        load_image(str(path), MediaPolicy())
    with pytest.raises(ValueError, match="outside"):
        load_image(str(path), MediaPolicy(allowed_local_root=tmp_path / "sub"))
    assert load_image(str(path), MediaPolicy(allowed_local_root=tmp_path)).size == (90, 60)


# ------------------------------------------------------------------------------- audio


def reference_16k(data: bytes) -> np.ndarray:
    wave, sr = sf.read(__import__("io").BytesIO(data), dtype="float32", always_2d=True)
    return soxr.resample(wave.mean(1), sr, 16000, quality="HQ")


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "OGG", "MP3"])
def test_audio_formats_decode_to_mono_16k(fmt, tmp_path):
    data = audio_bytes(fmt, seconds=1.0, sr=44100, channels=2)
    path = tmp_path / f"a.{fmt.lower()}"
    path.write_bytes(data)
    waves = [load_audio(s) for s in (data, str(path), data_url(data, "audio/x"))]
    for wave in waves:
        assert wave.dtype == np.float32 and wave.ndim == 1
        # mp3 and vorbis pad a little at the ends
        assert abs(len(wave) - 16000) < 0.1 * 16000, len(wave)
        np.testing.assert_array_equal(wave, waves[0])
    if fmt in ("WAV", "FLAC"):  # lossless: the exact downmix + resample of the file's samples
        np.testing.assert_allclose(waves[0], reference_16k(data), atol=1e-6)
        # ... which is the 440 Hz + 880 Hz mean, up to 16-bit rounding and resampling
        expected = sine(1.0, 16000, 2).mean(1)
        assert np.abs(waves[0][100:-100] - expected[100:-100]).max() < 2e-3


def test_audio_from_arrays():
    stereo = sine(0.5, 8000, 2)  # [samples, channels]
    wave = load_audio((stereo.T, 8000))  # [channels, samples] with its rate
    np.testing.assert_allclose(wave, soxr.resample(stereo.mean(1), 8000, 16000, quality="HQ"), atol=1e-6)
    np.testing.assert_array_equal(load_audio((stereo, 8000)), wave)  # [samples, channels] too
    mono = sine(0.5, 16000)[:, 0]
    np.testing.assert_array_equal(load_audio(mono), mono)  # a bare array is taken as 16 kHz
    pcm = (mono * 32767).astype(np.int16)
    np.testing.assert_allclose(load_audio((pcm, 16000)), mono, atol=1e-4)


def test_audio_via_ffmpeg_fallback():
    wave = load_audio(m4a_bytes(1.0))  # AAC: libsndfile cannot, PyAV can
    assert abs(len(wave) - 16000) < 2000 and np.abs(wave).max() > 0.1


@pytest.mark.parametrize("bad", [b"", b"garbage bytes that are no audio at all" * 10])
def test_undecodable_audio(bad):
    with pytest.raises(ValueError, match="cannot decode audio"):
        load_audio(bad)


def test_bad_audio_inputs():
    with pytest.raises(ValueError, match="invalid base64"):
        load_audio("data:audio/wav;base64,!!!!")
    with pytest.raises(ValueError, match="empty"):
        load_audio(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="NaN"):
        load_audio(np.array([0.0, np.nan], np.float32))


# ------------------------------------------------------------------------------- video


def test_video_sampling_and_resize():
    clip = load_video(mp4_bytes(n_frames=25, fps=10, size=(48, 64)))
    # 2.5 s at 2 fps = 5 frames -> rounded down to 4; evenly spread: frames 0, 8, 16, 24.
    assert clip.frames.shape == (4, 280, 392, 3)  # smart_resize up to >= 128*28*28 pixels
    assert clip.total_frames == 25 and clip.source_fps == 10
    assert clip.sample_fps == pytest.approx(4 / 25 * 10)
    gray = clip.frames[:, 140, 196, 0].astype(int)
    assert np.abs(gray - [0, 80, 160, 240]).max() <= 2, gray
    assert clip.audio is None


def test_video_from_files(tmp_path):
    path = tmp_path / "v.mp4"
    path.write_bytes(mp4_bytes(with_audio=True))
    clips = [load_video(s, with_audio=True) for s in (path, str(path), f"file://{path}")]
    for clip in clips:
        np.testing.assert_array_equal(clip.frames, clips[0].frames)
        np.testing.assert_array_equal(clip.audio, clips[0].audio)


def test_video_options_and_min_frames():
    data = mp4_bytes(n_frames=40, fps=10)
    clip = load_video(data, sampling=VideoSampling(fps=1.0, min_pixels=28 * 28, max_pixels=56 * 56))
    assert len(clip.frames) == 4  # 4 s at 1 fps = 4 (also min_frames)
    assert clip.frames.shape[1] * clip.frames.shape[2] <= 56 * 56
    clip = load_video(data, sampling=VideoSampling(fps=10.0, max_frames=10, min_pixels=784, max_pixels=3136))
    assert len(clip.frames) == 10
    short = load_video(mp4_bytes(n_frames=1))  # fewer frames than 2: the frame repeats
    assert len(short.frames) == 2 and np.array_equal(short.frames[0], short.frames[1])
    with pytest.raises(ValueError, match="must be positive"):
        VideoSampling().updated({"fps": 0})
    with pytest.raises(ValueError, match="unknown video option"):
        VideoSampling().updated({"frames": 3})


def test_video_audio_track_and_webm_like_containers():
    clip = load_video(mp4_bytes(n_frames=20, fps=10, with_audio=True), with_audio=True)
    assert clip.audio is not None and clip.audio.dtype == np.float32
    assert abs(len(clip.audio) - 2 * 16000) < 0.1 * 16000  # aac adds priming samples
    assert load_video(mp4_bytes(), with_audio=True).audio is None  # no track: None
    mkv = load_video(mp4_bytes(n_frames=12, fps=6, container="matroska"))  # no frame count in metadata
    assert len(mkv.frames) == 4 and mkv.total_frames == 12


def test_video_from_frames():
    frames = np.stack([np.full((30, 40, 3), 20 * i, np.uint8) for i in range(3)])
    clip = load_video(frames, frames_fps=3.0)
    assert len(clip.frames) == 4 and clip.sample_fps == 3.0  # padded by repeating the last
    clip = load_video([Image.fromarray(f) for f in frames], sampling=VideoSampling(min_pixels=784))
    assert len(clip.frames) == 4 and clip.frames.shape[1] % 28 == 0


@pytest.mark.parametrize("bad", [b"", b"\x00\x01garbage" * 100, mp4_bytes()[:300]])
def test_undecodable_video(bad):
    with pytest.raises(ValueError, match="cannot decode video"):
        load_video(bad)


# -------------------------------------------------------------------------------- http


@pytest.fixture(scope="module")
def http_server():
    png = image_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/slow.png":
                time.sleep(1.0)
            if self.path in ("/x.png", "/slow.png"):
                self.send_response(200)
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                try:
                    self.wfile.write(png)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass
            else:
                self.send_response(404)
                self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", png
    server.shutdown()


def test_http_fetch(http_server):
    base, png = http_server
    assert np.array_equal(np.asarray(load_image(f"{base}/x.png")), np.asarray(load_image(png)))
    with pytest.raises(ValueError, match="HTTP 404"):
        load_image(f"{base}/missing.png")
    with pytest.raises(ValueError, match="limit"):
        load_image(f"{base}/x.png", replace(TRUSTED, max_bytes=100))
    with pytest.raises(ValueError, match="timed out"):
        load_image(f"{base}/slow.png", replace(TRUSTED, timeout_s=0.2))
