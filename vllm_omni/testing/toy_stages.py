"""Test-only stage models and bridges for multi-stage pipelines built from tiny checkpoints.

A toy "thinker -> talker -> code2wav" pipeline: stage 0 is a tiny LM that exports its
hidden states; `latent_to_prompt_embeds` feeds them to stage 1 (another tiny LM) as
prompt embeddings; `concat_source_tokens` joins the token outputs of stages 0 and 1 for
the toy generation stage `ToyCode2Wav`, which maps token ids to rows of a seeded table
(one batched gather per step, like a real vocoder's single forward pass).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from vllm_omni.model_executor.models.generation_model import GenerationModel
from vllm_omni.stage_io import StageRequest
from vllm_omni.inputs import OmniTokensPrompt

TABLE_SEED = 1234
TABLE_WIDTH = 8  # samples per token


def latent_to_prompt_embeds(
    stage_list: list[Any], engine_input_source: list[int], prompt: Any = None, requires_multimodal_data: bool = False
) -> list[OmniTokensPrompt]:
    """Stage 0's final hidden states of every computed token become stage 1's prompt embeddings.

    The last sampled token was never fed back, so there is one row fewer than tokens.
    """
    inputs = []
    for out in stage_list[engine_input_source[0]].engine_outputs:
        hidden = out.outputs[0].multimodal_output["last"]  # [prompt + output - 1, hidden]
        tokens = (list(out.prompt_token_ids) + list(out.outputs[0].token_ids))[: hidden.shape[0]]
        inputs.append(OmniTokensPrompt(prompt_token_ids=tokens, additional_information={"prompt_embeds": hidden}))
    return inputs


def concat_source_tokens(
    stage_list: list[Any], engine_input_source: list[int], prompt: Any = None, requires_multimodal_data: bool = False
) -> list[OmniTokensPrompt]:
    """Several sources: the output token ids of each, in engine_input_source order."""
    per_source = [stage_list[src].engine_outputs for src in engine_input_source]
    return [
        OmniTokensPrompt(prompt_token_ids=[t for out in outs for t in out.outputs[0].token_ids])
        for outs in zip(*per_source)
    ]


class ToyCode2Wav(GenerationModel):
    """token ids -> a "waveform": the concatenated rows of a seeded [vocab, TABLE_WIDTH] table."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu") -> None:
        gen = torch.Generator().manual_seed(TABLE_SEED)
        self.table = torch.randn(vocab_size, TABLE_WIDTH, generator=gen).to(device)

    @classmethod
    def load(cls, model_path: str, *, model_stage: str | None, device: torch.device, dtype: str,
             load_format: str = "auto") -> ToyCode2Wav:
        config = json.loads((Path(model_path) / "config.json").read_text())
        return cls(int(config["vocab_size"]), device)

    def generate_batch(self, inputs: list[StageRequest]) -> list[dict[str, torch.Tensor]]:
        lengths = [len(req.prompt_token_ids) for req in inputs]
        ids = torch.zeros(len(inputs), max(lengths), dtype=torch.long)
        for i, req in enumerate(inputs):
            ids[i, : lengths[i]] = torch.tensor(req.prompt_token_ids)
        rows = self.table[ids.to(self.table.device)]  # [batch, max_len, TABLE_WIDTH]
        return [{"waveform": rows[i, :n].reshape(-1).cpu()} for i, n in enumerate(lengths)]

    def reference(self, token_ids: list[int]) -> torch.Tensor:
        return self.table[torch.tensor(token_ids)].reshape(-1).cpu()
