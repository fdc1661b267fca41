"""Quiet one known-false transformers warning, in every process that imports vllm_omni.

transformers 5 checks every `*_token_id` of a config against that config's vocabulary. The
Qwen2.5-Omni talker config stores thinker-vocabulary ids (`tts_text_*`, `vision_*`,
`audio_*`) next to its small codec vocabulary by design, so every process that loads the
real checkpoint (and the tiny demo) logs a dozen "must be within the vocabulary" warnings.
Only those fields are filtered; the same warning for any other field still shows.
"""
from __future__ import annotations

import logging
import re

_TALKER_FIELDS = re.compile(
    r"^Model config: (tts_text_(start|end|pad)|vision_(start|end)|audio_(start|end))_token_id must be `None` "
    r"or an integer within the vocabulary")


class _OmniTalkerTokenIds(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _TALKER_FIELDS.match(str(record.msg))


def install() -> None:
    logger = logging.getLogger("transformers.configuration_utils")
    if not any(isinstance(f, _OmniTalkerTokenIds) for f in logger.filters):
        logger.addFilter(_OmniTalkerTokenIds())
