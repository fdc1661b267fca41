"""/v1/audio/voices: the served model's preset voices and the voices clients make.

    GET    /v1/audio/voices          {"voices": [names], "task_type": ..., "data": [voice objects],
                                      "uploaded_voices": [upstream's entries of the stored voices]}
    POST   /v1/audio/voices          multipart: name, audio_sample (file), ref_text   -> voice object
                                     (x_vector_only_mode: true: no ref_text, the speaker row alone)
                                     VoiceDesign: name, instructions (a described voice, kept by name)
                                     either: consent, speaker_description (upstream's: stored, listed)
                                     -> + "success": true, "voice": upstream's entry
    GET    /v1/audio/voices/{name}   voice object; 404 unknown, 409 made for another checkpoint
    DELETE /v1/audio/voices/{name}   {"id", "object": "audio.voice.deleted", "deleted": true, "success": true,
                                      "message"}

A voice object: {"id", "object": "audio.voice", "name", "kind": "preset" | "cloned" | "designed",
"created_at", ...}; `voices` keeps the names (presets first), as before this store existed.
What the checkpoint's stored voices are made from its family says (SpeechModel.voices_from). A
cloned voice is encoded once when it is made (the family's VoiceCloning, in this process, one at
a time) and stored (voices_store.py); speaking with it (`speech_options`) hands the talker its
tensors. The uploaded audio is decoded through the media gate (`decode_sample`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from fastapi import Request
from starlette.datastructures import FormData, UploadFile

from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.tts_limits import VoiceLimits
from vllm_omni.entrypoints.openai.voices_store import DESIGNED_FINGERPRINT, StoredVoice, VoiceError, VoiceStore
from vllm_omni.imports import import_dotted
from vllm_omni.model_executor.models.family import SpeechModel, VoiceCloning
from vllm_omni.multimodal.media_policy import MediaPolicy

logger = logging.getLogger(__name__)

_FIELDS = {"name", "audio_sample", "ref_text", "instructions", "x_vector_only_mode", "consent",
           "speaker_description"}
_MAX_TEXT_FIELD = 64 * 1024
MAX_CONSENT_CHARS = 256  # upstream's consent: the id of a consent recording


def decode_sample(cloning: VoiceCloning, data: bytes, max_seconds: float, policy: MediaPolicy | None = None) -> Any:
    """An uploaded voice sample -> [N] float32 at the family's rate, as its input processor decodes
    an inline ref_audio (so a stored voice speaks as the same file given inline), through the
    media gate under the server's decode limits (`policy`) with the voice's duration cap: the
    decoder stops there, whatever the file's header declares. MediaError: undecodable or too long."""
    policy = policy or MediaPolicy()
    limits = dataclasses.replace(policy.limits, max_audio_s=min(policy.limits.max_audio_s, max_seconds),
                                 max_audio_s_flag="--max-voice-audio-s" if max_seconds < policy.limits.max_audio_s
                                 else policy.limits.max_audio_s_flag)
    return cloning.load_sample(data, dataclasses.replace(policy, limits=limits))


class VoicesService:
    def __init__(self, model_path: str, speech: SpeechModel | None, presets: list[str], limits: VoiceLimits,
                 max_instructions_length: int, media: MediaPolicy | None = None) -> None:
        """speech: what the TTS checkpoint says of itself (None: not a TTS model); presets: its named
        voices; media: the server's media policy (its decode limits)."""
        self.model_path = model_path
        self.media = media or MediaPolicy()
        self.task_type = speech.task_type if speech is not None else None
        self.voices_from = speech.voices_from if speech is not None else None
        self.cloning: VoiceCloning | None = None
        if speech is not None and speech.voice_cloning is not None:
            self.cloning = import_dotted(speech.voice_cloning)
        self.presets = presets
        self.limits = limits
        self.max_instructions_length = max_instructions_length
        self.store: VoiceStore | None = None
        self._encoder: Any = None
        self._encoding = asyncio.Lock()  # one encoding at a time: it takes the CPU

    @property
    def makes_voices(self) -> bool:
        return self.voices_from is not None

    @property
    def clones(self) -> bool:
        return self.voices_from == "audio"

    def open(self) -> None:
        """Load the voices folder (at startup: a cloning checkpoint's fingerprint hashes its encoders)."""
        if not self.makes_voices:
            return
        if self.clones:
            fingerprint = self.cloning.fingerprint(self.model_path)
        else:
            fingerprint = DESIGNED_FINGERPRINT
        self.store = VoiceStore.open(self.limits, fingerprint, self.model_path)

    # --- reading ------------------------------------------------------------------------
    def list(self) -> dict[str, Any]:
        stored = self.store.list() if self.store is not None else []
        data = [{"id": p, "object": "audio.voice", "name": p, "kind": "preset"} for p in self.presets]
        data += [v.wire() for v in stored]
        out: dict[str, Any] = {"voices": [*self.presets, *(v.name for v in stored)], "data": data,
                               "uploaded_voices": [v.upstream() for v in stored]}
        if self.task_type is not None:
            out["task_type"] = self.task_type
        return out

    def get(self, name: str) -> dict[str, Any]:
        preset = self._preset(name)
        if preset is not None:
            return {"id": preset, "object": "audio.voice", "name": preset, "kind": "preset"}
        return self._stored(name).wire()

    def _preset(self, name: str) -> str | None:
        return next((p for p in self.presets if p.lower() == name.lower()), None)

    def _stored(self, name: str) -> StoredVoice:
        if self.store is None:
            raise APIError(404, f"there is no voice {name!r}; this model's voices: {self.presets}")
        try:
            return self.store.get(name)
        except VoiceError as e:
            raise APIError(e.status, str(e)) from None

    def speech_options(self, voice: str | None, has_reference: bool, has_instructions: bool) -> dict[str, Any]:
        """What a request's `voice` adds to a TTS prompt: a preset's `speaker`, a cloned voice's
        encodings, a designed voice's instructions (`{}`: the voice names nothing here and the
        request brings its own: ref_audio, or instructions; the OpenAI client always sends one)."""
        if not voice:
            return {}
        if not self.makes_voices:
            return {"speaker": voice}  # the input processor names the voices if it is none of them
        try:
            stored = self.store.find(voice) if self.store is not None else None
        except VoiceError as e:
            raise APIError(400, str(e), param="voice") from None
        brings_own = has_reference if self.clones else has_instructions
        if stored is None:
            if brings_own or self.store is None:
                return {}
            names = [v.name for v in self.store.list()]
            raise APIError(400, f"unknown voice {voice!r}; stored voices: {names}" + (
                " (or give ref_audio and ref_text)" if self.clones else " (or give instructions)"),
                param="voice")
        if brings_own:
            what = "ref_audio / ref_text" if self.clones else "instructions"
            raise APIError(400, f"voice {stored.name!r} is a stored voice: give no {what} with it", param="voice")
        if stored.cloned is not None:
            return {"cloned_voice": stored.cloned}
        return {"instructions": stored.instructions}

    # --- changes ------------------------------------------------------------------------
    async def create(self, raw: Request) -> dict[str, Any]:
        if not self.makes_voices or self.store is None:
            what = "a text-to-speech model" if self.task_type is None else f"a {self.task_type} checkpoint"
            raise APIError(400, f"this server serves {what}, which makes no voices: voices are made on "
                                "checkpoints that clone them from audio or describe them in instructions")
        form = await _read_form(raw)
        name = _text(form, "name")
        if name is None:
            raise APIError(400, "'name' is required", param="name")
        self._check(lambda: self.store.check_new(name, self.presets))
        labels = self._labels(form)
        if not self.clones:
            voice = self._designed(name, form)
        else:
            voice = await self._cloned(name, form)
        voice = dataclasses.replace(voice, **labels)
        self._check(lambda: self.store.add(voice, self.presets))
        logger.info("voices: made %s voice %r", voice.kind, voice.name)
        return {**voice.wire(), "success": True, "voice": voice.upstream()}

    def _labels(self, form: FormData) -> dict[str, str | None]:
        """Upstream's `consent` and `speaker_description`: kept with the voice and listed."""
        labels = {"consent": _text(form, "consent"), "speaker_description": _text(form, "speaker_description")}
        limits = {"consent": MAX_CONSENT_CHARS, "speaker_description": self.max_instructions_length}
        for key, value in labels.items():
            if value is not None and len(value) > limits[key]:
                raise APIError(400, f"{key} is {len(value)} characters; the limit is {limits[key]}", param=key)
        return labels

    def delete(self, name: str) -> dict[str, Any]:
        if self._preset(name) is not None:
            raise APIError(400, f"{name!r} is a preset voice of this model; only stored voices can be deleted")
        voice = self._stored(name)
        self._check(lambda: self.store.delete(voice.name))
        return {"id": voice.name, "object": "audio.voice.deleted", "deleted": True, "success": True,
                "message": f"Voice '{voice.name}' deleted successfully"}

    @staticmethod
    def _check(action: Any) -> Any:
        try:
            return action()
        except VoiceError as e:
            raise APIError(e.status, str(e), param="name" if e.status in (400, 409) else None) from None

    def _designed(self, name: str, form: FormData) -> StoredVoice:
        for key in ("audio_sample", "ref_text", "x_vector_only_mode"):
            if key in form:
                raise APIError(400, f"a {self.task_type} checkpoint makes voices from 'instructions'; {key!r} is for "
                                    "checkpoints that clone voices from audio", param=key)
        instructions = (_text(form, "instructions") or "").strip()
        if not instructions:
            raise APIError(400, "a designed voice needs 'instructions' describing it", param="instructions")
        if len(instructions) > self.max_instructions_length:
            raise APIError(400, f"instructions are {len(instructions)} characters; the limit is "
                                f"{self.max_instructions_length} (--tts-max-instructions-length)", param="instructions")
        return StoredVoice(name, "designed", self.store.fingerprint, model=self.model_path, instructions=instructions)

    async def _cloned(self, name: str, form: FormData) -> StoredVoice:
        if "instructions" in form:
            raise APIError(400, f"a {self.task_type} checkpoint takes no instructions: its voice is the audio sample",
                           param="instructions")
        upload = form.get("audio_sample")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "'audio_sample' (an audio file of the voice) is required", param="audio_sample")
        if upload.size is not None and upload.size > self.limits.max_upload_bytes:
            raise APIError(413, f"the voice sample is {upload.size} bytes; the limit is "
                                f"{self.limits.max_upload_bytes} (--max-voice-bytes)", param="audio_sample")
        x_vector_only = (_text(form, "x_vector_only_mode") or "false").lower()
        if x_vector_only not in ("true", "false"):
            raise APIError(400, "x_vector_only_mode must be true or false", param="x_vector_only_mode")
        ref_text = _text(form, "ref_text")
        if x_vector_only == "true":
            if ref_text is not None:
                raise APIError(400, "an x-vector-only voice has no transcript: give no ref_text", param="ref_text")
        elif not (ref_text or "").strip():
            raise APIError(400, "'ref_text' (the transcript of the audio sample) is required, or "
                                "x_vector_only_mode=true to clone from the voice alone", param="ref_text")
        data = await upload.read(self.limits.max_upload_bytes + 1)
        cloned, seconds = await self.clone(data, ref_text, "audio_sample")
        return StoredVoice(name, "cloned", self.store.fingerprint, model=self.model_path, audio_seconds=seconds,
                           cloned=cloned, mime_type=upload.content_type or "application/octet-stream",
                           file_size=len(data))

    async def clone(self, data: bytes, ref_text: str | None, param: str) -> tuple[Any, float]:
        """A recording (and its transcript; None: x-vector only) -> (ClonedVoice, its seconds),
        under the voice limits: a stored voice's, or a speech socket session's own."""
        from vllm_omni.multimodal.media import MediaError

        if len(data) > self.limits.max_upload_bytes:
            raise APIError(413, f"the voice sample is over the {self.limits.max_upload_bytes} byte limit "
                                "(--max-voice-bytes)", param=param)
        async with self._encoding:
            try:
                wave = await asyncio.to_thread(decode_sample, self.cloning, data, self.limits.max_audio_s,
                                               self.media)
            except MediaError as e:
                raise APIError(400, f"cannot use the voice sample: {e}", param=param) from None
            cloned = await asyncio.to_thread(self._encode, wave, ref_text)
        return cloned, round(wave.shape[0] / self.cloning.sample_rate, 3)

    def _encode(self, wave: Any, ref_text: str | None) -> Any:
        if self._encoder is None:  # loaded once, at the first voice (its weights: a few hundred MB on CPU)
            self._encoder = self.cloning.encoder(self.model_path)
        return self._encoder.encode(wave, ref_text)


async def _read_form(raw: Request) -> FormData:
    try:
        form = await raw.form(max_files=1, max_fields=len(_FIELDS), max_part_size=_MAX_TEXT_FIELD)
    except Exception as e:  # noqa: BLE001 - starlette's MultiPartException and friends: a malformed body
        raise APIError(400, f"POST /v1/audio/voices takes multipart/form-data: {e}") from None
    unknown = sorted(set(form.keys()) - _FIELDS)
    if unknown:
        raise APIError(400, f"unsupported parameter {unknown[0]!r}; the fields are {sorted(_FIELDS)}", param=unknown[0])
    return form


def _text(form: FormData, key: str) -> str | None:
    value = form.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise APIError(400, f"{key!r} must be a text field", param=key)
    return value
