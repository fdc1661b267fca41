"""Qwen3-Omni thinker stage: audio + vision encoders feeding our Qwen3-MoE decoder.

The decoder is the shared Qwen3-MoE stack (per-head q/k RMSNorm, top-k routing with
renormalized top-k probabilities, per-expert checkpoint tensors loaded into fused experts)
with interleaved M-RoPE and DeepStack (deepstack.py). Per request, the model runner asks for
- `request_positions(request, start, end)`: [3, n] M-RoPE positions (rope_index.py), computed
  once from the prompt and `request.model_inputs` and kept in `request.model_state`; output
  tokens continue from the last prompt position, as transformers' generate does;
- `embed_request_span(request, start, end, token_ids)`: token embeddings with the encoder
  outputs written over the audio/image/video placeholders, and the span's DeepStack rows
  queued for the forward that follows. The encoders run once, at the request's first prompt
  span, so chunked prefill may cut the prompt anywhere.

`request.model_inputs` holds the processor outputs, parsed once (omni_thinker.ThinkerMediaInputs;
None for a text-only request).

Exported hidden states (for the talker): "0" (input embeddings, encoder outputs included) and
str(talker_config.accept_hidden_layer), transformers' `output_hidden_states` indices.

Checkpoint: the full Omni checkpoint; only `thinker.*` is ours (strictly), the talker and
code2wav tensors belong to other stages and are skipped. A thinker-only checkpoint (config
`Qwen3OmniMoeThinkerConfig`, names with or without `thinker.`) loads too.
"""
from __future__ import annotations

import copy

import torch
from transformers import PretrainedConfig

from vllm_omni.model_executor.models.omni_thinker import OmniThinkerForCausalLM
from vllm_omni.model_executor.models.qwen3_moe import make_qwen3_moe_layer
from vllm_omni.model_executor.models.qwen3_omni.deepstack import DeepstackDecoderModel, StepDeepstack
from vllm_omni.model_executor.models.qwen3_omni.rope_index import (
    RopeTokenConfig,
    GeneratedPositions,
    as_index_positions,
    qwen3_omni_rope_index,
)
from vllm_omni.model_executor.models.qwen3_omni.thinker_towers import (
    build_audio_tower,
    build_vision_tower,
    encode_audio,
    encode_vision,
)

_POSITIONS_KEY = "thinker_mrope"  # prompt positions [3, P] CPU (long, or float32 if fractional)
_GENERATED_KEY = "thinker_mrope_generated"  # GeneratedPositions of the output tokens
_MM_KEY = "thinker_mm"  # _PromptMedia of the request, dropped once the prompt is computed


class _PromptMedia:
    """Encoder outputs of one prompt, indexed by prompt position.

    rows[p]: row of `features` that replaces token p's embedding, or -1;
    visual_rows[p]: row of `deepstack` [L, N_visual, H] added after layers 0..L-1, or -1.
    Index maps live on the CPU so slicing a span needs no device sync.
    """

    def __init__(self, num_prompt: int) -> None:
        self.rows = torch.full((num_prompt,), -1, dtype=torch.long)
        self.visual_rows = torch.full((num_prompt,), -1, dtype=torch.long)
        self.features: list[torch.Tensor] = []
        self.deepstack: list[torch.Tensor] = []

    def place(self, mask: torch.Tensor, feats: torch.Tensor, deepstack: torch.Tensor | None) -> None:
        offset = sum(f.shape[0] for f in self.features)
        self.rows[mask] = torch.arange(offset, offset + feats.shape[0])
        self.features.append(feats)
        if deepstack is not None:
            offset = sum(d.shape[1] for d in self.deepstack)
            self.visual_rows[mask] = torch.arange(offset, offset + feats.shape[0])
            self.deepstack.append(deepstack)

    def finish(self) -> _PromptMedia:
        self.features = torch.cat(self.features)
        self.deepstack = torch.cat(self.deepstack, dim=1) if self.deepstack else None
        return self


class Qwen3OmniMoeThinkerForConditionalGeneration(OmniThinkerForCausalLM):
    # Decode steps replay CUDA graphs where the MoE layers can be captured (grouped GEMMs: the
    # runner checks); DeepStack rows only ever join prefill steps, which run eagerly.

    def __init__(self, config: PretrainedConfig):
        # The stage is built from the whole Omni config; a bare thinker config works too.
        thinker_config = getattr(config, "thinker_config", config)
        text_config = copy.deepcopy(thinker_config.text_config)
        # transformers ties lm_head by the thinker config's flag; its text config class has none.
        text_config.tie_word_embeddings = bool(getattr(
            thinker_config, "tie_word_embeddings", getattr(text_config, "tie_word_embeddings", False)))
        model = DeepstackDecoderModel(text_config, lambda i: make_qwen3_moe_layer(text_config, i))
        super().__init__(text_config, model)
        self.thinker_config = thinker_config
        # Built from the whole Omni config, the checkpoint holds every stage and ours are `thinker.*`.
        self.whole_omni_checkpoint = thinker_config is not config
        self.rope_tokens = RopeTokenConfig.from_config(thinker_config)
        self.audio_tower = build_audio_tower(thinker_config.audio_config)
        self.visual = build_vision_tower(thinker_config.vision_config)
        self.step_deepstack = StepDeepstack()

    @classmethod
    def exported_hidden_states(cls, hf_config: PretrainedConfig) -> tuple[int, ...]:
        """(0, accept_hidden_layer) for a whole Omni config (what its talker reads); (0,) without
        a talker config."""
        accept = getattr(getattr(hf_config, "talker_config", None), "accept_hidden_layer", None)
        return (0,) if accept is None else tuple(dict.fromkeys((0, int(accept))))

    # --- forward ----------------------------------------------------------------
    def begin_step(self) -> None:
        self.step_deepstack.clear()

    def forward(self, input_ids, positions, *, inputs_embeds=None, capture_layers=()):
        deepstack = self.step_deepstack.take(positions.shape[-1])
        return self.model(input_ids, positions, inputs_embeds, capture_layers, deepstack)

    def prefill_graphable(self, request) -> bool:
        """Not with images or videos: DeepStack adds their features inside the forward, by
        host-side lengths. Text and audio prompts replay the prefill graphs."""
        inputs = request.model_inputs
        return inputs is None or (inputs.pixel_values is None and inputs.pixel_values_videos is None)

    # --- per-request inputs -----------------------------------------------------
    def _prompt_positions(self, request) -> torch.Tensor:
        cached = request.model_state.get(_POSITIONS_KEY)
        if cached is None:
            positions, _ = qwen3_omni_rope_index(
                request.prompt_token_ids, self.rope_tokens, **request.model_inputs.rope_index_kwargs()
            )
            cached = as_index_positions(positions)
            self._check_position_limit(request, cached)
            request.model_state[_POSITIONS_KEY] = cached
        return cached

    def _check_position_limit(self, request, positions: torch.Tensor) -> None:
        # Long positions index the rotary tables; float ones are computed, but keep the same bound.
        limit = self.model.rotary_emb.max_position
        if float(positions.max()) >= limit:
            raise ValueError(f"request {request.request_id}: M-RoPE position {float(positions.max())} >= {limit}")

    def _generated_positions(self, request) -> GeneratedPositions:
        # Generated tokens continue each row from the last prompt position, as transformers'
        # generate does (+1 per step); the last position need not be the largest.
        continued = request.model_state.get(_GENERATED_KEY)
        if continued is None:
            continued = request.model_state[_GENERATED_KEY] = GeneratedPositions(self._prompt_positions(request)[:, -1:])
        return continued

    def decode_positions(self, request, position: int) -> tuple[int, int, int]:
        num_prompt = request.num_prompt_tokens
        if request.model_inputs is None:
            return (position,) * 3
        if position < num_prompt:
            return super().decode_positions(request, position)
        values = self._generated_positions(request).at(position - num_prompt)
        if max(values) >= self.model.rotary_emb.max_position:
            raise ValueError(f"request {request.request_id}: M-RoPE position {max(values)} >= "
                             f"{self.model.rotary_emb.max_position}")
        return values

    def request_positions(self, request, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of tokens start..end-1 of `request` (prompt and output)."""
        num_prompt = request.num_prompt_tokens
        if request.model_inputs is None:  # text only: HF's positions are plain 0, 1, 2, ...
            return torch.arange(start, end).view(1, -1).expand(3, -1)
        positions = self._prompt_positions(request)
        spans = [positions[:, start : min(end, num_prompt)]] if start < num_prompt else []
        if end > num_prompt:
            generated = self._generated_positions(request).span(max(start, num_prompt) - num_prompt, end - num_prompt)
            self._check_position_limit(request, generated)
            spans.append(generated)
        return torch.cat(spans, dim=1)

    def _encode_prompt_media(self, request) -> _PromptMedia:
        inputs = request.model_inputs
        ids = torch.tensor(request.prompt_token_ids, dtype=torch.long)
        media = _PromptMedia(len(ids))
        tokens = self.rope_tokens
        encoded = []  # (kind, placeholder id, features, deepstack or None), in HF's merge order
        if inputs.input_features is not None:
            feats = encode_audio(self.audio_tower, inputs.input_features, inputs.audio_lengths)
            encoded.append(("audio", tokens.audio_token_id, feats, None))
        if inputs.pixel_values is not None:
            feats, deepstack = encode_vision(self.visual, inputs.pixel_values, inputs.image_grid_thw)
            encoded.append(("image", tokens.image_token_id, feats, deepstack))
        if inputs.pixel_values_videos is not None:
            feats, deepstack = encode_vision(self.visual, inputs.pixel_values_videos, inputs.video_grid_thw)
            encoded.append(("video", tokens.video_token_id, feats, deepstack))
        for kind, token_id, feats, deepstack in encoded:
            mask = ids == token_id
            count = int(mask.sum())
            if count != feats.shape[0]:
                raise ValueError(f"request {request.request_id}: {count} {kind} placeholder tokens "
                                 f"but {feats.shape[0]} {kind} features")
            media.place(mask, feats, deepstack)
        return media.finish()

    def embed_request_span(self, request, start: int, end: int, token_ids: torch.Tensor) -> torch.Tensor:
        """[end - start, H] input embeddings of tokens start..end-1 (`token_ids` are those tokens)."""
        embeds = self.get_input_embeddings(token_ids)
        num_prompt = request.num_prompt_tokens
        if start >= num_prompt or request.model_inputs is None:
            self.step_deepstack.add(end - start)
            return embeds
        media = request.model_state.get(_MM_KEY)
        if media is None:
            media = request.model_state[_MM_KEY] = self._encode_prompt_media(request)
        span = slice(start, min(end, num_prompt))
        span_rows = media.rows[span]
        dst = torch.nonzero(span_rows >= 0).squeeze(1)
        if dst.numel():
            embeds[dst.to(embeds.device)] = media.features[span_rows[dst].to(embeds.device)].to(embeds.dtype)
        visual = media.visual_rows[span]
        vdst = torch.nonzero(visual >= 0).squeeze(1)
        if vdst.numel() and media.deepstack is not None and media.deepstack.shape[0]:
            picked = media.deepstack[:, visual[vdst].to(media.deepstack.device)]
            self.step_deepstack.add(end - start, vdst.to(embeds.device), picked)
        else:
            self.step_deepstack.add(end - start)
        if end >= num_prompt:
            # Prompt done: free the encoder outputs (a recompute after preemption encodes again).
            del request.model_state[_MM_KEY]
        return embeds
