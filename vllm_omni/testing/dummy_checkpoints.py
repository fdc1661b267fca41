"""Weightless checkpoint folders of real omni architectures, for benchmarks on the GPU.

`make_dummy_omni_checkpoint(config_json, out_dir)` writes the real config.json plus the side
files the stages read (a tokenizer, preprocessor config, generation config, and for
Qwen2.5-Omni a `spk_dict.pt` of the real shapes). Stages then run with
`load_format: dummy`: random weights of the real shapes and cost, nothing downloaded.

The tokenizer is the tiny test tokenizer: its ids do not match the real vocabulary, so
benchmarks send `chat_prompt_ids(...)`, token ids laid out like a real ChatML prompt with the
config's own special ids (the Qwen3-Omni talker checks for the assistant turn).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

# Qwen2/Qwen3 vocabulary ids of the ChatML words (the Qwen3-Omni config names the same ids).
IM_START, IM_END, NEWLINE = 151644, 151645, 198
SYSTEM, USER, ASSISTANT = 8948, 872, 77091
# Ordinary text ids to draw random prompt words from.
TEXT_IDS = (1000, 100000)
# Speaker text-side bos ids of the released Qwen2.5-Omni spk_dict.pt.
QWEN2_5_SPEAKERS = {"Chelsie": 151870, "Ethan": 151871}


def make_dummy_omni_checkpoint(config_json: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    from vllm_omni.testing.tiny_omni import PREPROCESSOR_CONFIG
    from vllm_omni.testing.tokenizer import make_tiny_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads(Path(config_json).read_text())
    (out / "config.json").write_text(json.dumps(config, indent=1))
    make_tiny_tokenizer().save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END], "pad_token_id": 151643}))
    if "token2wav_config" in config:
        dit = config["token2wav_config"]["dit_config"]
        g = torch.Generator().manual_seed(seed)
        speakers = {
            name: {"bos_token": bos, "cond": torch.randn(1, dit["enc_emb_dim"], generator=g),
                   "ref_mel": torch.randn(1, 300, dit["mel_dim"], generator=g)}
            for name, bos in QWEN2_5_SPEAKERS.items()
        }
        torch.save(speakers, out / "spk_dict.pt")
    return out


def chat_prompt_ids(num_words: int, seed: int = 0) -> list[int]:
    """A one-turn ChatML prompt in the real vocabulary: system, user (random words), assistant."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(*TEXT_IDS, (num_words,), generator=g).tolist()
    return ([IM_START, SYSTEM, NEWLINE] + torch.randint(*TEXT_IDS, (8,), generator=g).tolist()
            + [IM_END, NEWLINE, IM_START, USER, NEWLINE] + words
            + [IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE])
