"""The fixed inputs run through qwen-tts (make_reference.py) and through our pipeline (tests).

Plain data only: this file is read by both environments (the reference venv has none of our
package). Each case is one request; `call` names the qwen-tts method.
"""
from __future__ import annotations

import math

MAX_NEW_TOKENS = 16  # frames per case: enough to show divergence, small fixtures
SEED = 0  # make_tiny_model seed of every tiny checkpoint used here
REF_SAMPLE_RATE = 24000


def reference_audio(seconds: float = 1.2, sample_rate: int = REF_SAMPLE_RATE) -> list[float]:
    """A deterministic voice-like signal (harmonics with a vibrato), peak 0.5."""
    n = int(seconds * sample_rate)
    out = []
    for i in range(n):
        t = i / sample_rate
        f0 = 140.0 + 12.0 * math.sin(2 * math.pi * 3.0 * t)
        phase = 2 * math.pi * f0 * t
        out.append(0.5 * (0.6 * math.sin(phase) + 0.3 * math.sin(2 * phase + 0.4) + 0.1 * math.sin(5 * phase)))
    return out


# Fixture name -> the tiny checkpoint (make_tiny_model overrides): the three task types at the
# default size, and the 0.6B releases' shape (testing/tiny_qwen3_tts.py; no 0.6B VoiceDesign).
CHECKPOINTS: dict[str, dict] = {
    "CustomVoice": {"task_type": "CustomVoice"},
    "VoiceDesign": {"task_type": "VoiceDesign"},
    "Base": {"task_type": "Base"},
    "CustomVoice_0.6B": {"task_type": "CustomVoice", "size": "0.6B"},
    "Base_0.6B": {"task_type": "Base", "size": "0.6B"},
}

CASES: dict[str, list[dict]] = {
    "CustomVoice": [
        {"name": "named_speaker", "text": "Hello! How are you today?", "speaker": "vivian", "language": "Auto"},
        {"name": "instructions", "text": "The weather is nice today, so we are going to the park.",
         "speaker": "ryan", "language": "English", "instruct": "Speak happily and fast."},
        {"name": "dialect_speaker", "text": "What is the capital of France?", "speaker": "eric",
         "language": "Chinese"},
        {"name": "streaming_text", "text": "A journey of a thousand miles begins with a single step.",
         "speaker": "Vivian", "language": "Auto", "non_streaming_mode": False},
    ],
    "VoiceDesign": [
        {"name": "described_voice", "text": "Once upon a time there was a little girl.",
         "instruct": "A deep, calm male voice.", "language": "Auto"},
        {"name": "german", "text": "Please write a short poem about the sea.", "instruct": "A bright young voice.",
         "language": "German"},
    ],
    "Base": [
        {"name": "icl_clone", "text": "Can you tell me a story about a robot?", "ref_text": "You are a helpful assistant.",
         "language": "Auto"},
        {"name": "xvector_only", "text": "She sells sea shells by the sea shore.", "x_vector_only_mode": True,
         "language": "English"},
        {"name": "icl_clone_non_streaming", "text": "Numbers: 1 2 3.", "ref_text": "The quick brown fox.",
         "language": "Auto", "non_streaming_mode": True},
    ],
    # The 0.6B CustomVoice model takes no instructions (qwen-tts drops them; we refuse them).
    "CustomVoice_0.6B": [
        {"name": "named_speaker", "text": "Hello! How are you today?", "speaker": "ryan", "language": "English"},
        {"name": "dialect_speaker", "text": "What is the capital of France?", "speaker": "eric", "language": "Auto"},
        {"name": "streaming_text", "text": "A journey of a thousand miles begins with a single step.",
         "speaker": "vivian", "language": "Auto", "non_streaming_mode": False},
    ],
    "Base_0.6B": [
        {"name": "icl_clone", "text": "Can you tell me a story about a robot?", "ref_text": "You are a helpful assistant.",
         "language": "Auto"},
        {"name": "xvector_only", "text": "She sells sea shells by the sea shore.", "x_vector_only_mode": True,
         "language": "English"},
    ],
}
