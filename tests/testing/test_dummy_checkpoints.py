"""Weightless checkpoints of the real omni architectures (benchmarks on the GPU): chat text
through their tokenizer reaches the ids the configs name, as `chat_prompt_ids` lays them out."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from vllm_omni.testing.dummy_checkpoints import chat_prompt_ids, make_dummy_omni_checkpoint

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


@pytest.mark.parametrize("name", ["qwen3_omni_30b_a3b", "qwen2_5_omni_7b"])
def test_chat_text_reaches_the_configs_chatml_ids(tmp_path, name):
    path = make_dummy_omni_checkpoint(CONFIGS / f"{name}.json", tmp_path / name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}],
                                         add_generation_prompt=True, tokenize=True)["input_ids"]
    laid_out = chat_prompt_ids(3)
    # Both start a turn and end with the assistant's header, with the same ids.
    assert text[:2] == [laid_out[0], 872] and text[-3:] == laid_out[-3:]
    assert tokenizer.decode(text) == "<|im_start|>user\nTell me about the sea.<|im_end|>\n<|im_start|>assistant\n"
    config = json.loads((path / "config.json").read_text())
    if "im_start_token_id" in config:  # Qwen3-Omni: the talker finds the turns by these ids
        assert text[-3:-1] == [config["im_start_token_id"], config["assistant_token_id"]]
        assert text[1] == config["user_token_id"] and config["im_end_token_id"] in text
