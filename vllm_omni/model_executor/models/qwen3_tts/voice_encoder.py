"""A cloned voice encoded once: what the talker computes from `ref_audio`, kept for reuse.

    encoder = VoiceEncoder.load(model_dir)              # CPU, float32: the reference arithmetic
    voice = encoder.encode(audio_24k, ref_text)          # ClonedVoice(speaker [H], codes [F, G])
    prompt = {"prompt": "Hello!", "cloned_voice": voice} # no encoder runs for this request

The server's voices store (entrypoints/openai/voices_store.py) encodes an uploaded reference
with this, in its own process, and hands the tensors with each request; the talker then skips
both encoders (talker.py, `ref_speaker` / `ref_codes`). On the CPU in float32 the talker runs
the same modules on the same samples, so a stored voice speaks exactly as its reference given
inline (tests/server/test_voices.py); on a GPU the inline path rounds on the device.

`voice_fingerprint` names what a stored voice depends on: the speaker encoder and the speech
tokenizer's encoder (their configs and weights). A voice is valid for any checkpoint with the
same fingerprint and refused by others.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_omni.model_executor.models.qwen3_tts.configuration import SpeakerEncoderConfig, TaskType, TTSConfig
from vllm_omni.model_executor.models.qwen3_tts.speaker_encoder import SpeakerEncoder
from vllm_omni.model_executor.models.qwen3_tts.speech_encoder import ENCODER_PREFIX, SpeechEncoder

SPEAKER_PREFIX = "speaker_encoder."
SPEECH_TOKENIZER_DIR = "speech_tokenizer"


@dataclass(frozen=True)
class ClonedVoice:
    """speaker: [H] float32, the speaker encoder's row; codes: [F, G] long, the reference's
    codes (None: the voice clones from the speaker row alone, qwen-tts' x_vector_only_mode);
    ref_text: the reference's transcript (with codes)."""

    speaker: torch.Tensor
    codes: torch.Tensor | None = None
    ref_text: str | None = None

    def __post_init__(self) -> None:
        if self.speaker.dim() != 1 or not self.speaker.is_floating_point():
            raise ValueError("a cloned voice's speaker row must be a 1-D float tensor")
        if (self.codes is None) != (self.ref_text is None):
            raise ValueError("a cloned voice has codes and their transcript, or neither")
        if self.codes is not None and (self.codes.dim() != 2 or self.codes.dtype != torch.long):
            raise ValueError("a cloned voice's codes must be [frames, groups] int64")

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"speaker": self.speaker.contiguous()}
        if self.codes is not None:
            out["codes"] = self.codes.contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], ref_text: str | None) -> ClonedVoice:
        unknown = set(tensors) - {"speaker", "codes"}
        if unknown or "speaker" not in tensors:
            raise ValueError(f"not a cloned voice: tensors {sorted(tensors)}")
        return cls(tensors["speaker"], tensors.get("codes"), ref_text)


class VoiceEncoder:
    """The Base checkpoint's speaker encoder and speech tokenizer encoder, on the CPU in float32."""

    def __init__(self, speaker: SpeakerEncoder, speech: SpeechEncoder) -> None:
        self.speaker = speaker.eval()
        self.speech = speech.eval()

    @classmethod
    def load(cls, model_dir: str | Path) -> VoiceEncoder:
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "config.json")
        tts = TTSConfig.parse({**config, "_name_or_path": str(model_dir)})
        if tts.task_type is not TaskType.BASE:
            raise ValueError(f"cloned voices need a Base checkpoint; this is a {tts.task_type.value} model")
        speaker = SpeakerEncoder(tts.speaker_encoder)
        speaker.load_state_dict(_tensors(model_dir, SPEAKER_PREFIX), strict=True)
        codec = _read_json(model_dir / SPEECH_TOKENIZER_DIR / "config.json")
        speech = SpeechEncoder(codec["encoder_config"], codec["encoder_valid_num_quantizers"],
                               codec["encode_downsample_rate"])
        speech.load_released(_tensors(model_dir / SPEECH_TOKENIZER_DIR, ENCODER_PREFIX))
        return cls(speaker, speech)

    @torch.inference_mode()
    def encode(self, audio: torch.Tensor, ref_text: str | None) -> ClonedVoice:
        """audio: [N] float32 at 24 kHz (multimodal/qwen3_tts_input.load_reference_audio);
        ref_text None: a voice from the speaker row alone."""
        speaker = self.speaker.embed(audio).float().cpu()
        codes = self.speech.encode(audio).long().cpu() if ref_text is not None else None
        return ClonedVoice(speaker, codes, ref_text)


def voice_fingerprint(model_dir: str | Path) -> str:
    """A digest of what a cloned voice depends on: both encoders' configs and weights (their bytes
    as stored, read by the safetensors header: no tensor is loaded)."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    codec = _read_json(model_dir / SPEECH_TOKENIZER_DIR / "config.json")
    speaker_config = SpeakerEncoderConfig(**{k: v for k, v in (config.get("speaker_encoder_config") or {}).items()
                                             if k in SpeakerEncoderConfig.__dataclass_fields__})
    digest = hashlib.blake2b(digest_size=16)
    described = {"speaker_encoder": speaker_config.__dict__, "encoder": codec.get("encoder_config"),
                 "valid_quantizers": codec.get("encoder_valid_num_quantizers"),
                 "samples_per_frame": codec.get("encode_downsample_rate")}
    digest.update(json.dumps(described, sort_keys=True, default=list).encode())
    for folder, prefix in ((model_dir, SPEAKER_PREFIX), (model_dir / SPEECH_TOKENIZER_DIR, ENCODER_PREFIX)):
        for file in _weight_files(folder):
            _hash_tensors(digest, file, prefix)
    return digest.hexdigest()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    return json.loads(path.read_text(encoding="utf-8"))


def _weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards its index names."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(_read_json(index)["weight_map"].values()))]
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ValueError(f"{folder}: no model.safetensors (cloned voices need the checkpoint's weights)")
    return [single]


def _tensors(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            out.update({k[len(prefix):]: f.get_tensor(k).float() for k in f.keys() if k.startswith(prefix)})
    if not out:
        raise ValueError(f"{folder}: no {prefix}* weights")
    return out


def _hash_tensors(digest: Any, file: Path, prefix: str) -> None:
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        for name in sorted(k for k in header if k.startswith(prefix)):
            entry = header[name]
            start, end = entry["data_offsets"]
            digest.update(f"{name}:{entry['dtype']}:{entry['shape']}".encode())
            f.seek(8 + size + start)
            remaining = end - start
            while remaining:
                block = f.read(min(remaining, 1 << 22))
                if not block:
                    raise ValueError(f"{file}: {name} ends past the end of the file")
                digest.update(block)
                remaining -= len(block)
