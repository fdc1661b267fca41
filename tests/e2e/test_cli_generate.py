"""The README's main command, `vllm-omni generate` with no model: the embedded tiny Qwen2.5-Omni
demo through `Omni` (three stage processes), text printed, speech written to wav files."""
from __future__ import annotations

import shutil

import soundfile as sf

from vllm_omni.entrypoints.cli.main import main
from vllm_omni.testing.tiny_models import DEMO_MODEL_NAMES


def test_generate_runs_the_demo_omni_pipeline(omni_dir, tmp_path, monkeypatch, capsys):
    # The demo model is the tiny omni checkpoint (seed 0): reuse the session's copy, no rebuild.
    cache = tmp_path / "cache"
    shutil.copytree(omni_dir, cache / DEMO_MODEL_NAMES["qwen2_5_omni"])
    monkeypatch.setenv("VLLM_OMNI_CACHE", str(cache))
    out_dir = tmp_path / "out"
    assert main(["generate", "--prompt", "Hi", "--prompt", "Bye", "--speaker", "Ethan", "--max-tokens", "5",
                 "--output-dir", str(out_dir)]) == 0
    printed = capsys.readouterr().out
    assert "embedded demo model" in printed and "[0] prompt: 'Hi'" in printed and "[1] text: " in printed
    for i in range(2):
        wav, rate = sf.read(out_dir / f"reply_{i}.wav")
        assert rate == 24000 and wav.ndim == 1 and len(wav) > 0
        assert f"{out_dir / f'reply_{i}.wav'} (" in printed
