"""Weightless checkpoint folders of real omni architectures, for benchmarks on the GPU.

`make_dummy_omni_checkpoint(config_json, out_dir)` writes the real config.json plus the side
files the stages read (a tokenizer, preprocessor config, generation config, and for
Qwen2.5-Omni a `spk_dict.pt` of the real shapes). Stages then run with
`load_format: dummy`: random weights of the real shapes and cost, nothing downloaded.

The tokenizer is the tiny test tokenizer: its ids do not match the real vocabulary, so
in-process benchmarks send `chat_prompt_ids(...)`, token ids laid out like a real ChatML prompt
with the config's own special ids (the Qwen3-Omni talker checks for the assistant turn). Chat
text (a server's messages) must reach the same ids: in the checkpoint's copy the ChatML tokens
(`<|im_start|>`, `<|im_end|>`, `system`, `user`, `assistant`) carry the real vocabulary's ids.
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
    _real_chatml_ids(out / "tokenizer.json")
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


def _real_chatml_ids(tokenizer_json: Path) -> None:
    """Give the saved tiny tokenizer's ChatML tokens the real ids (the vocabulary may skip ids:
    the model's embeddings have the real vocabulary's rows)."""
    real = {"<|im_start|>": IM_START, "<|im_end|>": IM_END, "system": SYSTEM, "user": USER, "assistant": ASSISTANT}
    spec = json.loads(tokenizer_json.read_text())
    vocab = spec["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in spec["added_tokens"]}
    if taken & set(real.values()):
        raise ValueError(f"{tokenizer_json}: the tiny tokenizer already uses ids of the real ChatML tokens")
    for word in ("system", "user", "assistant"):
        if word not in vocab:
            raise ValueError(f"{tokenizer_json}: {word!r} is not one token of the tiny tokenizer")
    for token in spec["added_tokens"]:
        if token["content"] in real:  # an added token keeps the id the model's vocabulary gives it
            token["id"] = real[token["content"]]
    vocab.update(real)
    tokenizer_json.write_text(json.dumps(spec, ensure_ascii=False))


def chat_prompt_ids(num_words: int, seed: int = 0) -> list[int]:
    """A one-turn ChatML prompt in the real vocabulary: system, user (random words), assistant."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(*TEXT_IDS, (num_words,), generator=g).tolist()
    return ([IM_START, SYSTEM, NEWLINE] + torch.randint(*TEXT_IDS, (8,), generator=g).tolist()
            + [IM_END, NEWLINE, IM_START, USER, NEWLINE] + words
            + [IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE])
