"""The TTS server that tests/server/test_voices_and_stream.py and test_voices_upstream.py share
(the `voices_server` fixture, conftest.py): one real `vllm-omni serve` of the tiny Qwen3-TTS Base
checkpoint (greedy, so equal inputs give equal audio) with --api-key, a voices folder and small
caps, and what both modules use to reach it.
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import httpx
import numpy as np
import openai
import soundfile as sf

from tests.conftest import in_threads
from tests.server.conftest import REPO, ServerProcess

KEY = "voices-key"
FRAMES = 40  # codec frames per utterance at most (greedy, EOS seldom comes first with these weights)
# Both stages run as threads of the server (nothing here is about stage processes).
OVERRIDES = json.dumps(in_threads(2, {
    "0": {"max_num_seqs": 4, "default_sampling_params": {"max_tokens": FRAMES, "temperature": 0.0}},
    "1": {"max_num_seqs": 4}}))
MAX_VOICE_BYTES = 120_000
MAX_VOICE_AUDIO_S = 3
MAX_VOICES = 5
MAX_TEXT_CHARS = 2000
MAX_FRAME_BYTES = 4096
MAX_BATCH_ITEMS = 3
LSB_SLACK = 4  # PCM16 steps between a batched item and the same request alone (float rounding only)
IDLE_S = 4  # --realtime-idle-timeout-s (the socket shares the realtime session limits)
REF_TEXT = "Hello there."
SPF = 1920  # samples per codec frame
# Phrases whose tokens are those of the whole text (each later phrase starts with its space).
PHRASES = ["Good morning, my friend.", " The sun is out today.", " Let us walk to the park!"]
DOCS = REPO / "docs" / "tts.md"


def wav_bytes(seconds: float, rate: int = 16000, pitch: float = 150.0) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, 0.4 * np.sin(2 * np.pi * pitch * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t)), rate, format="WAV")
    return buf.getvalue()


def foreign_voice(folder: Path) -> None:
    """A voice file made on another checkpoint (another encoder fingerprint)."""
    from safetensors.torch import save_file
    import torch

    record = {"name": "elsewhere", "kind": "cloned", "fingerprint": "0" * 32, "created_at": 1, "model": "other-model",
              "instructions": None, "audio_seconds": 1.0, "ref_text": None}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"speaker": torch.zeros(64)}, str(folder / "elsewhere.safetensors"),
              metadata={"vllm_omni_voice": json.dumps(record)})


def earlier_voice(ckpt: Path, folder: Path) -> None:
    """`dora`, made as a server would have made it, before this server starts."""
    from vllm_omni.entrypoints.openai.serving_voices import decode_sample
    from vllm_omni.entrypoints.openai.tts_limits import VoiceLimits
    from vllm_omni.entrypoints.openai.voices_store import StoredVoice, VoiceStore
    from vllm_omni.model_executor.models.qwen3_tts.voice_encoder import VoiceEncoder, voice_fingerprint
    from vllm_omni.multimodal.qwen3_tts_voices import Qwen3TTSVoiceCloning

    store = VoiceStore.open(VoiceLimits(folder), voice_fingerprint(ckpt), str(ckpt))
    wave = decode_sample(Qwen3TTSVoiceCloning, wav_bytes(1.5, pitch=190.0), 10.0)
    cloned = VoiceEncoder.load(ckpt).encode(wave, REF_TEXT)
    store.add(StoredVoice("dora", "cloned", store.fingerprint, model=str(ckpt), audio_seconds=1.5, cloned=cloned), [])


def launch(ckpt: Path, voices: Path, log: Path) -> ServerProcess:
    return ServerProcess.launch([
        str(ckpt), "--served-model-name", "tts", "--api-key", KEY, "--stage-overrides", OVERRIDES,
        "--voices-dir", str(voices), "--max-voices", str(MAX_VOICES), "--max-voice-bytes", str(MAX_VOICE_BYTES),
        "--max-voice-audio-s", str(MAX_VOICE_AUDIO_S), "--speech-stream-max-text-chars", str(MAX_TEXT_CHARS),
        "--speech-stream-max-frame-bytes", str(MAX_FRAME_BYTES), "--realtime-idle-timeout-s", str(IDLE_S),
        "--speech-batch-max-items", str(MAX_BATCH_ITEMS)],
        log).wait_ready()


class Client:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        self.openai = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def make(self, name: str, audio: bytes | None = None, **fields) -> httpx.Response:
        files = {"audio_sample": ("sample.wav", audio, "audio/wav")} if audio is not None else None
        return self.http.post("/v1/audio/voices", data={"name": name, **fields}, files=files)

    def speak(self, text: str = "How are you today?", voice: str = "alloy", **extra) -> bytes:
        return self.openai.audio.speech.create(model="tts", input=text, voice=voice, response_format="pcm",
                                               extra_body=extra or None).content


def error_of(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


def ws_url(server: ServerProcess) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream"


def words(text: str) -> list[str]:
    return re.findall(r"\S+\s*", text)
