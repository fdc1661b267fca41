"""Shared pieces of the end-to-end tests: the tiny Qwen3-Omni checkpoint with audible voices,
one pipeline of each with real stage processes for the whole package (`omni25`, `omni3`),
media as a client sends them (data URLs, base64 audio, raw arrays) and small per-stage
sampling params.

`omni25` and `omni3` are the bundled configs (every edge streams) with BATCH_8, started once
and used by every test that needs that pipeline: read counters as differences (before/after),
never as totals. Pipelines of other settings run their stages as threads (`in_threads`)
unless the test is about stage processes.
"""
from __future__ import annotations

import base64
import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.multimodal.media_files import audio_bytes, image_bytes, mp4_bytes, sine

# The Ray module runs in an interpreter of its own (test_ray_in_a_fresh_process.py says why).
RAY_MODULE = "test_qwen2_5_omni_ray.py"
RAY_IN_THIS_PROCESS = "RAY_TESTS_IN_THIS_PROCESS"
collect_ignore = [] if os.environ.get(RAY_IN_THIS_PROCESS) == "1" else [RAY_MODULE]

# Small budgets keep the whole folder fast on 2 CPU cores: thinker tokens, talker codes.
THINKER_TOKENS, TALKER_TOKENS = 8, 24
# Every stage batches up to 8 requests (the bundled deploy config runs them one by one).
BATCH_8 = {str(s): {"max_num_seqs": 8} for s in range(3)}
# Video frames of 2x2 merged patches instead of the default minimum of 128 (the vision tower's
# cost on CPU); also exercises per-request video sampling options.
SMALL_VIDEO = {"min_pixels": 28 * 28, "max_pixels": 4 * 28 * 28}


@pytest.fixture(scope="session")
def qwen3_omni_voices_dir(qwen3_omni_dir, tmp_path_factory):
    """The tiny Qwen3-Omni checkpoint with audible voices: its random speaker rows (one talker
    prompt row among many) barely move the codes, so the same request spoke alike in both
    voices and a voice lost on the way would go unnoticed. 5x the rows makes them change the codes."""
    path = tmp_path_factory.mktemp("qwen3-omni-voices")
    shutil.copytree(qwen3_omni_dir, path, dirs_exist_ok=True)
    voices = json.loads((path / "config.json").read_text())["talker_config"]["speaker_id"]
    weights = load_file(path / "model.safetensors")
    weights["talker.model.codec_embedding.weight"][list(voices.values())] *= 5
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="package")
def omni25(omni_dir):
    """Qwen2.5-Omni, bundled configs, BATCH_8, three stage processes: shared by the package."""
    from vllm_omni import Omni

    with Omni(model=str(omni_dir), stage_overrides=BATCH_8) as omni:
        yield omni


@pytest.fixture(scope="package")
def omni3(qwen3_omni_voices_dir):
    """Qwen3-Omni (audible voices), bundled configs, BATCH_8, three stage processes: shared by the package."""
    from vllm_omni import Omni

    with Omni(model=str(qwen3_omni_voices_dir), stage_overrides=BATCH_8) as omni:
        yield omni


def short_params(thinker=THINKER_TOKENS, talker=TALKER_TOKENS, code2wav_seed=None) -> list:
    """Per-stage overrides of the bundled defaults (the talker keeps its seeded sampling)."""
    return [{"max_tokens": thinker}, {"max_tokens": talker}, None if code2wav_seed is None else {"seed": code2wav_seed}]


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def mixed_prompts() -> list:
    """8 prompts across text, audio+text, image+text and video+text, in the shapes clients use."""
    wav = audio_bytes("WAV", seconds=0.8, sr=22050, channels=1)
    png = image_bytes("PNG", size=(90, 60), seed=1)
    mp4 = mp4_bytes(n_frames=20, fps=10, size=(48, 64))
    mp4_sound = mp4_bytes(n_frames=20, fps=10, size=(48, 64), with_audio=True)
    text = lambda s: {"type": "text", "text": s}  # noqa: E731
    return [
        "Tell me a story.",  # raw prompt: tokenized as is
        {"messages": [{"role": "user", "content": "Hello there"}], "speaker": "Ethan"},
        {"messages": user({"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(),
                                                                   "format": "wav"}}, text("What is this?"))},
        {"messages": user({"type": "audio", "audio": (sine(0.5, 16000)[:, 0], 16000)}, text("Transcribe."))},
        {"messages": user({"type": "image_url", "image_url": {"url": data_url("image/png", png)}},
                          text("Describe the image."))},
        # vLLM style: a template-form prompt with placeholders + multi_modal_data.
        {"prompt": "<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|>What?<|im_end|>\n<|im_start|>assistant\n",
         "multi_modal_data": {"image": png}, "speaker": "Chelsie"},
        {"messages": user({"type": "video_url", "video_url": {"url": data_url("video/mp4", mp4)}},
                          text("What happens?")),
         "mm_processor_kwargs": SMALL_VIDEO},
        {"messages": user({"type": "video_url", "video_url": {"url": data_url("video/mp4", mp4_sound)}},
                          text("And here?")),
         "mm_processor_kwargs": {"use_audio_in_video": True, **SMALL_VIDEO}},
    ]


def by_request(outputs) -> list[dict[str, object]]:
    """Outputs grouped per request, in prompt order: {final_output_type: output}."""
    grouped: dict[str, dict[str, object]] = {}
    for out in outputs:
        grouped.setdefault(out.request_id, {})[out.final_output_type] = out
    return list(grouped.values())
