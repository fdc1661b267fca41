"""The served model's voices: `GET /v1/audio/voices` -> {"voices": ["Chelsie", "Ethan"]}.

An omni model's voices are its talker's speakers (Qwen2.5-Omni: spk_dict.pt; Qwen3-Omni:
talker_config.speaker_id), read by its family's input processor. A pipeline without an audio
output (a thinker-only config) has none.
"""
from __future__ import annotations

import json
from pathlib import Path

from vllm_omni.imports import import_dotted
from vllm_omni.model_executor.models.families import family_of


def model_voices(model_path: str, can_speak: bool) -> tuple[str, ...]:
    if not can_speak:
        return ()
    config_path = Path(model_path) / "config.json"
    if not config_path.is_file():
        return ()
    family = family_of(json.loads(config_path.read_text(encoding="utf-8")))
    if family is None or family.input_processor is None:
        return ()
    processor = import_dotted(family.input_processor)
    return tuple(processor.speaker_names(Path(model_path)) or ())
