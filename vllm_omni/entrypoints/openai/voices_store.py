"""Voices a client made (`POST /v1/audio/voices`), kept in a folder across restarts.

    store = VoiceStore.open(VoiceLimits(folder), fingerprint, model_label)   # loads the folder (tts_limits.py)
    store.add(StoredVoice(...))        # written atomically: <name>.safetensors (tmp + os.replace)
    store.get("alice")                 # VoiceError 404 (unknown) / 409 (made for another checkpoint)
    store.delete("alice")

One file per voice: a cloned voice's tensors (models/cloned_voice.ClonedVoice: the speaker row and
the reference codes) with its record in the safetensors metadata (name, kind, transcript,
creation time, the fingerprint of the checkpoint's encoders); a designed voice (VoiceDesign) is
its record alone. Every voice of this checkpoint is loaded into memory at start, so speaking
with one reads no file and runs no encoder. Voices of other checkpoints in the same folder are
listed nowhere and refused by name, with the reason. Names: `NAME_PATTERN` (no paths), unique
ignoring case. A server reads the folder when it starts: servers sharing a folder see each
other's new voices after a restart.
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_omni.entrypoints.openai.tts_limits import VoiceLimits
from vllm_omni.model_executor.models.cloned_voice import ClonedVoice

logger = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SUFFIX = ".safetensors"
DESIGNED_FINGERPRINT = "voice-design"  # a description: valid on any VoiceDesign checkpoint


class VoiceError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class StoredVoice:
    name: str
    kind: str  # "cloned" | "designed"
    fingerprint: str
    created_at: int = field(default_factory=lambda: int(time.time()))
    model: str = ""  # the checkpoint it was made with (for messages)
    instructions: str | None = None  # designed
    audio_seconds: float | None = None  # cloned: the reference's duration
    cloned: ClonedVoice | None = None
    # upstream vLLM-Omni's fields, kept and listed as given
    consent: str | None = None
    speaker_description: str | None = None
    mime_type: str | None = None  # cloned: the uploaded sample's
    file_size: int | None = None

    @property
    def key(self) -> str:
        return self.name.lower()

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.name, "object": "audio.voice", "name": self.name, "kind": self.kind,
                               "created_at": self.created_at}
        if self.cloned is not None:
            out.update(ref_text=self.cloned.ref_text, audio_seconds=self.audio_seconds,
                       mode="in_context" if self.cloned.codes is not None else "x_vector_only")
        if self.instructions is not None:
            out["instructions"] = self.instructions
        return out | {k: v for k, v in self._upstream_fields().items() if v is not None}

    def upstream(self) -> dict[str, Any]:
        """The voice as upstream vLLM-Omni's clients read it (its `uploaded_voices` entries)."""
        out: dict[str, Any] = {"name": self.name, "consent": self.consent or "", "created_at": self.created_at,
                               "file_size": self.file_size or 0, "mime_type": self.mime_type or ""}
        if self.cloned is not None and self.cloned.ref_text is not None:
            out["ref_text"] = self.cloned.ref_text
        if self.speaker_description is not None:
            out["speaker_description"] = self.speaker_description
        return out

    def _upstream_fields(self) -> dict[str, Any]:
        return {"consent": self.consent, "speaker_description": self.speaker_description,
                "mime_type": self.mime_type, "file_size": self.file_size}

    def metadata(self) -> dict[str, str]:
        record = {"name": self.name, "kind": self.kind, "fingerprint": self.fingerprint, "created_at": self.created_at,
                  "model": self.model, "instructions": self.instructions, "audio_seconds": self.audio_seconds,
                  "ref_text": self.cloned.ref_text if self.cloned is not None else None, **self._upstream_fields()}
        return {"vllm_omni_voice": json.dumps(record)}


@dataclass(frozen=True)
class _Foreign:
    name: str
    model: str
    fingerprint: str


class VoiceStore:
    def __init__(self, limits: VoiceLimits, fingerprint: str, model_label: str) -> None:
        self.limits = limits
        self.folder = limits.resolved_folder
        self.fingerprint = fingerprint
        self.model_label = model_label
        self.voices: dict[str, StoredVoice] = {}  # by key: this checkpoint's
        self.foreign: dict[str, _Foreign] = {}  # by key: other checkpoints' (refused with the reason)

    @classmethod
    def open(cls, limits: VoiceLimits, fingerprint: str, model_label: str) -> VoiceStore:
        store = cls(limits, fingerprint, model_label)
        for path in sorted(store.folder.glob(f"*{SUFFIX}")):  # (made with the first voice)
            store._load(path)
        logger.info("voices: %d of this model and %d of others in %s", len(store.voices), len(store.foreign),
                    store.folder)
        return store

    def _load(self, path: Path) -> None:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                record = json.loads((f.metadata() or {})["vllm_omni_voice"])
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            name = record["name"]
            if path.name != _file_name(name):
                raise ValueError(f"holds voice {name!r}")
            if record["fingerprint"] != self.fingerprint:
                self.foreign[name.lower()] = _Foreign(name, record.get("model", ""), record["fingerprint"])
                return
            cloned = ClonedVoice.from_tensors(tensors, record.get("ref_text")) if tensors else None
            self.voices[name.lower()] = StoredVoice(
                name, record["kind"], record["fingerprint"], int(record["created_at"]), record.get("model", ""),
                record.get("instructions"), record.get("audio_seconds"), cloned, record.get("consent"),
                record.get("speaker_description"), record.get("mime_type"), record.get("file_size"))
        except Exception as e:  # noqa: BLE001 - one unreadable file must not stop the server
            logger.warning("voices: skipping %s (%s: %s)", path, type(e).__name__, e)

    # --- queries --------------------------------------------------------------------
    def list(self) -> list[StoredVoice]:
        return sorted(self.voices.values(), key=lambda v: v.key)

    def find(self, name: str) -> StoredVoice | None:
        """This checkpoint's voice of that name (any case), None if there is none;
        VoiceError 409 when the name is a voice of another checkpoint."""
        voice = self.voices.get(name.lower())
        if voice is None and name.lower() in self.foreign:
            other = self.foreign[name.lower()]
            raise VoiceError(409, f"voice {other.name!r} was made for another checkpoint ({other.model or 'unknown'}, "
                                  f"encoder fingerprint {other.fingerprint}); this server's is {self.fingerprint} "
                                  f"({self.model_label}): make the voice again on this model")
        return voice

    def get(self, name: str) -> StoredVoice:
        voice = self.find(name)
        if voice is None:
            raise VoiceError(404, f"there is no voice {name!r}")
        return voice

    # --- changes --------------------------------------------------------------------
    def check_new(self, name: str, reserved: list[str]) -> None:
        """A voice of this name may be made (VoiceError: why not)."""
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise VoiceError(400, f"voice names are 1-64 letters, digits, '_', '.', '-', starting with a letter or "
                                  f"digit; got {name!r}")
        if name.lower() in (r.lower() for r in reserved):
            raise VoiceError(400, f"{name!r} is a preset voice of this model")
        if name.lower() in self.voices or name.lower() in self.foreign:
            raise VoiceError(409, f"a voice named {name!r} exists; delete it first")
        if len(self.voices) + len(self.foreign) >= self.limits.max_voices:
            raise VoiceError(400, f"the voices folder holds {self.limits.max_voices} voices, its limit "
                                  "(--max-voices): delete one first")

    def add(self, voice: StoredVoice, reserved: list[str]) -> None:
        from safetensors.torch import save_file

        self.check_new(voice.name, reserved)  # again: another request may have taken the name meanwhile
        tensors = voice.cloned.tensors() if voice.cloned is not None else {}
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=SUFFIX)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=voice.metadata())
            os.replace(tmp, self.folder / _file_name(voice.name))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.voices[voice.key] = voice

    def delete(self, name: str) -> StoredVoice:
        voice = self.get(name)
        (self.folder / _file_name(voice.name)).unlink(missing_ok=True)
        del self.voices[voice.key]
        return voice


def _file_name(name: str) -> str:
    return name.lower() + SUFFIX  # one file per name whatever the case (and on case-blind disks)
