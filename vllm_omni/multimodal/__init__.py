"""Multimodal inputs: loading media and turning chat messages into model inputs.

media.py       images and audio from objects, bytes, data URLs, http(s) URLs, files
media_fetch.py the media gate: data URLs, guarded downloads (url_guard.py), local files
media_policy.py  MediaPolicy (where media may come from), DecodeLimits, per-request budget
video.py       video decoding (PyAV), frame sampling, audio track extraction
vision.py      Qwen2-VL resize rules and video patchification (no IO)
chat_parts.py  OpenAI-style content parts -> template parts + media items
chat_template.py                the Qwen2.5-Omni chat template
qwen2_5_omni_processor.py       messages / prompt + media -> ThinkerPrompt (ids + tensors)
qwen2_5_omni_placeholders.py    placeholder expansion and audio features for it
Errors in client-supplied input raise media.MediaError (a ValueError): an HTTP 400.
"""
