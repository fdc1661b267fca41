"""The README's main command, `vllm-omni generate` with no model: the embedded tiny Qwen2.5-Omni
demo through `Omni` (three stage processes), text printed, speech written to wav files that
one can hear (about a second, loud enough)."""
from __future__ import annotations

import numpy as np
import soundfile as sf

from vllm_omni.entrypoints.cli.main import main


def test_generate_runs_the_demo_omni_pipeline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_OMNI_CACHE", str(tmp_path / "cache"))  # built here, as on a new machine
    out_dir = tmp_path / "out"
    assert main(["generate", "--prompt", "Hi", "--prompt", "Bye", "--speaker", "Ethan", "--max-tokens", "5",
                 "--output-dir", str(out_dir)]) == 0
    printed = capsys.readouterr().out
    assert "embedded demo model" in printed and "[0] prompt: 'Hi'" in printed and "[1] text: " in printed
    for i in range(2):
        wav, rate = sf.read(out_dir / f"reply_{i}.wav")
        assert rate == 24000 and wav.ndim == 1 and len(wav) >= 0.8 * rate  # audible: a second,
        assert np.sqrt(np.mean(wav**2)) > 0.01  # not -60 dB
        assert f"{out_dir / f'reply_{i}.wav'} (" in printed
