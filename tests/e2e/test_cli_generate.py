"""The README's main command, `vllm-omni generate` with no model: the embedded tiny Qwen2.5-Omni
demo through `Omni`, its words printed, its speech written to wav files that one can hear (a
tenth of a second per word, loud enough). Its three stages run as threads (`--stage-overrides`):
what is checked is the command's output; the demo's stage processes are the README example's
(test_readme_examples.py) and the demo server's (tests/server/test_server_demo.py), and
`generate` with a stage process is tests/diffusion/test_offline_api.py's."""
from __future__ import annotations

import ast
import json
import re

import numpy as np
import pytest
import soundfile as sf

from tests.conftest import in_threads
from vllm_omni.entrypoints.cli.main import main
from vllm_omni.testing import make_tiny_tokenizer
from vllm_omni.testing.demo_model import DEFAULT_REPLY_TOKENS, SECONDS_PER_CODE, demo_words


def test_generate_runs_the_demo_omni_pipeline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_OMNI_CACHE", str(tmp_path / "cache"))  # built here, as on a new machine
    out_dir = tmp_path / "out"
    assert main(["generate", "--prompt", "Hi", "--prompt", "Bye", "--speaker", "Ethan",
                 "--output-dir", str(out_dir), "--stage-overrides", json.dumps(in_threads(3))]) == 0
    printed = capsys.readouterr().out
    assert "embedded demo model" in printed and "[0] prompt: 'Hi'" in printed
    vocabulary = {w.strip() for w in demo_words(make_tiny_tokenizer()).values()}
    texts = [ast.literal_eval(t) for t in re.findall(r"\[\d\] text: ('.*?'|\".*?\")  \[length\]", printed)]
    assert len(texts) == 2
    for i, text in enumerate(texts):
        assert len(text.split()) == DEFAULT_REPLY_TOKENS and set(text.split()) <= vocabulary  # short, words
        wav, rate = sf.read(out_dir / f"reply_{i}.wav")
        assert rate == 24000 and wav.ndim == 1
        assert len(wav) / rate == pytest.approx(DEFAULT_REPLY_TOKENS * SECONDS_PER_CODE) and len(wav) >= rate
        assert np.sqrt(np.mean(wav**2)) > 0.02  # not -60 dB
        assert f"{out_dir / f'reply_{i}.wav'} (" in printed
