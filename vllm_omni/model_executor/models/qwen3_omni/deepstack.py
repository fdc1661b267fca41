"""The Qwen3-Omni thinker's decoder stack: our shared decoder plus DeepStack and its rotary.

DeepStack (transformers' `Qwen3OmniMoeThinkerTextModel._deepstack_process`): the vision
encoder returns one extra feature map per `deepstack_visual_indexes` entry; map i is added to
the hidden states of the image/video tokens right after decoder layer i. Hidden states
captured for export follow HF's `output_hidden_states`, which records each layer's output
*before* that addition.

The rotary is interleaved M-RoPE whatever the config says (HF's Qwen3-Omni always
interleaves, and defaults `mrope_section` to [24, 20, 20]). Positions are long (exact cos/sin
table rows) or float32 (fractional video times, see rope_index.py), whose angles are
computed directly as HF does: `pos.float() * inv_freq`, then cos/sin.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from vllm_omni.model_executor.forward_context import get_forward_context
from vllm_omni.model_executor.layers.rotary import SUPPORTED_ROPE_TYPES, MRotaryEmbedding, default_inv_freq
from vllm_omni.model_executor.models.decoder import DecoderLayer, DecoderModel, config_head_dim

HF_DEFAULT_MROPE_SECTION = [24, 20, 20]


class InterleavedMRotaryEmbedding(MRotaryEmbedding):
    """Interleaved M-RoPE that also takes float32 positions."""

    def __init__(self, head_dim: int, rope_parameters: dict, max_position: int):
        rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
        theta = float(rope_parameters["rope_theta"])
        section = rope_parameters.get("mrope_section") or HF_DEFAULT_MROPE_SECTION
        super().__init__(head_dim, theta, max_position, section, interleaved=True)
        self.register_buffer("inv_freq", default_inv_freq(head_dim, theta).to(self.cos_cache.device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not positions.is_floating_point():
            return super().cos_sin(positions, dtype)
        freqs = positions.float()[..., None] * self.inv_freq  # [3, T, D/2] or [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if positions.dim() == 2:  # pick each frequency's row (t, h or w), as the table path does
            index = self.axis.view(1, 1, -1).expand(1, positions.shape[1], -1)
            cos, sin = cos.gather(0, index)[0], sin.gather(0, index)[0]
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)


@dataclass
class DeepstackInputs:
    rows: torch.Tensor  # [n] long: the visual tokens' rows in the step's packed tokens
    embeds: torch.Tensor  # [num_deepstack_layers, n, H]


class StepDeepstack:
    """DeepStack rows of one step, collected span by span while the runner embeds the step's
    requests (`embed_request_span`, in batch order) and taken by the forward that follows."""

    def __init__(self) -> None:
        self._spans: list[tuple[int, torch.Tensor | None, torch.Tensor | None]] = []

    def clear(self) -> None:
        self._spans = []

    def add(self, num_tokens: int, rows: torch.Tensor | None = None, embeds: torch.Tensor | None = None) -> None:
        """One request's span of `num_tokens`; `rows` (span-local) and `embeds` [L, n, H] when it has visual tokens."""
        self._spans.append((num_tokens, rows, embeds))

    def take(self, num_tokens: int) -> DeepstackInputs | None:
        spans, self._spans = self._spans, []
        if all(embeds is None for _, _, embeds in spans):
            return None
        lengths = [n for n, _, _ in spans]
        meta = get_forward_context()
        # A span list left over from a step that never ran forward must not shift rows onto other tokens.
        if sum(lengths) != num_tokens or (meta is not None and meta.query_lens_cpu and lengths != meta.query_lens_cpu):
            raise RuntimeError(f"DeepStack spans {lengths} do not match this step's {num_tokens} tokens")
        rows, embeds, offset = [], [], 0
        for n, span_rows, span_embeds in spans:
            if span_embeds is not None:
                rows.append(span_rows + offset)
                embeds.append(span_embeds)
            offset += n
        return DeepstackInputs(torch.cat(rows), torch.cat(embeds, dim=1))


class DeepstackDecoderModel(DecoderModel):
    def __init__(self, config: PretrainedConfig, make_layer: Callable[[int], DecoderLayer]):
        super().__init__(config, make_layer)
        # Replaces the base class's rotary (built from the config's own layout flag).
        self.rotary_emb = InterleavedMRotaryEmbedding(
            config_head_dim(config), config.rope_parameters, config.max_position_embeddings
        )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        capture_layers: Collection[int] = (),
        deepstack: DeepstackInputs | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """DecoderModel.forward plus `deepstack` (same capture indices as HF's output_hidden_states)."""
        if deepstack is None:
            return super().forward(input_ids, positions, inputs_embeds, capture_layers)
        bad = [i for i in capture_layers if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"capture_layers {bad} out of range [0, {self.num_layers}]")
        if deepstack.embeds.shape[0] > self.num_layers:
            raise ValueError(f"{deepstack.embeds.shape[0]} DeepStack feature maps for {self.num_layers} layers")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        captured: dict[int, torch.Tensor] = {0: hidden} if 0 in capture_layers else {}
        cos, sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, cos, sin)
            if i + 1 < self.num_layers and i + 1 in capture_layers:
                captured[i + 1] = hidden + residual
            if i < deepstack.embeds.shape[0]:
                # Materialize the layer output (HF's `residual + hidden`), add the features at the
                # visual rows in HF's order, and hand the next layer a plain stream (residual None).
                hidden, residual = hidden + residual, None
                rows = deepstack.rows
                hidden[rows] = hidden[rows] + deepstack.embeds[i].to(hidden.dtype)
        hidden = self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]
        if self.num_layers in capture_layers:
            captured[self.num_layers] = hidden
        return hidden, captured
