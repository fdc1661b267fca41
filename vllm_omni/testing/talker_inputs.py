"""A talker request without running a thinker: a ChatML prompt and a finished thinker reply of
random hidden states, handed over by the family's own thinker2talker bridge (what
benchmarks/bench_talker_step.py and the GPU talker tests feed a talker stage alone)."""
from __future__ import annotations

from typing import Any

import torch

from vllm_omni.engine.stage_input import StageView
from vllm_omni.outputs import CompletionOutput, RequestOutput

TALKER_FAMILIES = ("qwen2_5_omni", "qwen3_omni")


def chat_prompt_ids(model_dir: str, user_words: int) -> list[int]:
    """A one-turn ChatML prompt with the checkpoint tokenizer's special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    special = tok.convert_tokens_to_ids
    user = tok(" ".join(["hello"] * user_words))["input_ids"]
    return [special("<|im_start|>"), special("user"), 198, *user, special("<|im_end|>"), 198,
            special("<|im_start|>"), special("assistant"), 198]


def talker_prompt(talker: Any, family: str, prompt_ids: list[int], reply_rows: int, seed: int) -> dict[str, Any]:
    """{"prompt_token_ids", "additional_information"} for `talker` (the stage model) after a
    thinker reply of `reply_rows` + 1 tokens to `prompt_ids`."""
    if family == "qwen3_omni":
        from vllm_omni.model_executor.models.qwen3_omni.bridges import thinker2talker

        width, layers = talker.config.thinker_hidden_size, ("0", str(talker.config.accept_hidden_layer))
    elif family == "qwen2_5_omni":
        from vllm_omni.model_executor.models.qwen2_5_omni.bridges import thinker2talker

        width, layers = talker.config.embedding_size, ("0", "last")
    else:
        raise ValueError(f"unknown talker family {family!r}; expected one of {TALKER_FAMILIES}")
    g = torch.Generator().manual_seed(seed)
    rows = len(prompt_ids) + reply_rows
    # Embeddings at an embedding table's scale, hidden states at a final norm's.
    states = {key: torch.randn(rows, width, generator=g) * (0.02 if key == "0" else 1.0) for key in layers}
    reply = CompletionOutput(0, "", list(range(reply_rows + 1)), finish_reason="stop", multimodal_output=states)
    thinker_out = RequestOutput(f"thinker-{seed}", None, prompt_ids, [reply], finished=True)
    [prompt] = thinker2talker([StageView(0, [thinker_out])], [0], None, False)
    return prompt
