"""Qwen2.5-Omni thinker stage: audio + vision encoders feeding our Qwen2 decoder with TMRoPE.

The decoder is the shared Qwen2 stack (qkv bias) whose rotary is M-RoPE (`mrope_section`
in the text config). Per request, the model runner asks for
- `request_positions(request, start, end)`: [3, n] TMRoPE positions (positions.py), computed
  once from the prompt and `request.model_inputs` and kept in `request.model_state`; output
  tokens continue from the last prompt position like transformers' generate;
- `embed_request_span(request, start, end, token_ids)`: token embeddings with the encoder
  outputs written over the audio/image/video placeholder tokens. The encoders run once, at
  the request's first prompt span, so chunked prefill may cut the prompt anywhere.

`request.model_inputs` holds the processor outputs, parsed once (omni_thinker.ThinkerMediaInputs;
None for a text-only request).

Checkpoint: the full Omni checkpoint; only `thinker.*` is ours (strictly), the talker and
token2wav tensors belong to other stages and are skipped. A thinker-only checkpoint (config
`Qwen2_5OmniThinkerConfig`, names with or without `thinker.`) loads too.
"""
from __future__ import annotations

import torch
from transformers import PretrainedConfig

from vllm_omni.model_executor.models.decoder import DecoderModel
from vllm_omni.model_executor.models.omni_thinker import OmniThinkerForCausalLM, ThinkerMediaInputs
from vllm_omni.model_executor.models.qwen2 import make_qwen2_layer
from vllm_omni.model_executor.models.qwen2_5_omni.positions import MRopeTokenConfig, omni_rope_index
from vllm_omni.model_executor.models.qwen2_5_omni.towers import (
    build_audio_tower,
    build_vision_tower,
    encode_audio,
    encode_vision,
)

_POSITIONS_KEY = "thinker_mrope"  # (prompt positions [3, P] CPU long, HF rope delta)
_LAST_POSITIONS_KEY = "thinker_mrope_last"  # (t, h, w) of the last prompt token, ints
_MM_KEY = "thinker_mm"  # (rows [P] CPU long: row in embeds or -1, embeds [N, H] on device)


class Qwen2_5OmniThinkerForConditionalGeneration(OmniThinkerForCausalLM):
    def __init__(self, config: PretrainedConfig):
        # The stage is built from the whole Omni config; a bare thinker config works too.
        thinker_config = getattr(config, "thinker_config", config)
        text_config = thinker_config.text_config
        super().__init__(text_config, DecoderModel(text_config, lambda i: make_qwen2_layer(text_config, i)))
        self.thinker_config = thinker_config
        # Built from the whole Omni config, the checkpoint holds every stage and ours are `thinker.*`.
        self.whole_omni_checkpoint = thinker_config is not config
        self.max_position_embeddings = text_config.max_position_embeddings
        self.rope_tokens = MRopeTokenConfig.from_config(thinker_config)
        self.audio_tower = build_audio_tower(thinker_config.audio_config)
        self.visual = build_vision_tower(thinker_config.vision_config)

    # --- per-request inputs -----------------------------------------------------
    def _prompt_positions(self, request) -> tuple[torch.Tensor, int]:
        cached = request.model_state.get(_POSITIONS_KEY)
        if cached is None:
            cached = omni_rope_index(
                request.prompt_token_ids, self.rope_tokens, **request.model_inputs.rope_index_kwargs()
            )
            limit = self.model.rotary_emb.max_position
            if int(cached[0].max()) >= limit:
                raise ValueError(f"request {request.request_id}: M-RoPE position {int(cached[0].max())} >= {limit}")
            request.model_state[_POSITIONS_KEY] = cached
        return cached

    def decode_positions(self, request, position: int) -> tuple[int, int, int]:
        num_prompt = request.num_prompt_tokens
        if request.model_inputs is None:
            return (position,) * 3
        if position < num_prompt:
            return super().decode_positions(request, position)
        last = request.model_state.get(_LAST_POSITIONS_KEY)
        if last is None:
            last = request.model_state[_LAST_POSITIONS_KEY] = tuple(self._prompt_positions(request)[0][:, -1].tolist())
        values = tuple(v + position - num_prompt + 1 for v in last)  # as request_positions continues them
        if max(values) >= self.model.rotary_emb.max_position:
            raise ValueError(f"request {request.request_id}: M-RoPE position beyond the rotary table")
        return values

    def request_positions(self, request, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of tokens start..end-1 of `request` (prompt and output)."""
        num_prompt = request.num_prompt_tokens
        if request.model_inputs is None:  # text only: HF's positions are plain 0, 1, 2, ...
            return torch.arange(start, end).view(1, -1).expand(3, -1)
        positions, _ = self._prompt_positions(request)
        spans = [positions[:, start : min(end, num_prompt)]] if start < num_prompt else []
        if end > num_prompt:
            # Generated tokens continue each row from the last prompt position, as transformers'
            # generate does (it extends position_ids by +1). This is not always max + 1: with
            # use_audio_in_video the closing markers can sit below the video's largest t.
            steps = torch.arange(max(start, num_prompt) - num_prompt, end - num_prompt) + 1
            generated = positions[:, -1:] + steps
            if int(generated.max()) >= self.model.rotary_emb.max_position:
                raise ValueError(f"request {request.request_id}: M-RoPE position beyond the rotary table")
            spans.append(generated)
        return torch.cat(spans, dim=1)

    def _encode_media(self, inputs: ThinkerMediaInputs) -> list[tuple[str, int, torch.Tensor]]:
        """(kind, placeholder token id, encoder output rows in prompt order) per media kind present."""
        media = []
        if inputs.input_features is not None:
            rows = encode_audio(self.audio_tower, inputs.input_features, inputs.audio_lengths)
            media.append(("audio", self.rope_tokens.audio_token_id, rows))
        if inputs.pixel_values is not None:
            rows = encode_vision(self.visual, inputs.pixel_values, inputs.image_grid_thw)
            media.append(("image", self.rope_tokens.image_token_id, rows))
        if inputs.pixel_values_videos is not None:
            rows = encode_vision(self.visual, inputs.pixel_values_videos, inputs.video_grid_thw)
            media.append(("video", self.rope_tokens.video_token_id, rows))
        return media

    def _encode_prompt_features(self, request) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [P] CPU: each prompt position's row in features, or -1; features [N, H])."""
        ids = torch.tensor(request.prompt_token_ids, dtype=torch.long)
        rows = torch.full_like(ids, -1)
        features, offset = [], 0
        for kind, token_id, feats in self._encode_media(request.model_inputs):
            mask = ids == token_id
            count = int(mask.sum())
            if count != feats.shape[0]:
                raise ValueError(f"request {request.request_id}: {count} {kind} placeholder tokens "
                                 f"but {feats.shape[0]} {kind} features")
            rows[mask] = torch.arange(offset, offset + count)
            offset += count
            features.append(feats)
        return rows, torch.cat(features)

    def embed_request_span(self, request, start: int, end: int, token_ids: torch.Tensor) -> torch.Tensor:
        """[end - start, H] input embeddings of tokens start..end-1 (`token_ids` are those tokens)."""
        embeds = self.get_input_embeddings(token_ids)
        num_prompt = request.num_prompt_tokens
        if start >= num_prompt or request.model_inputs is None:
            return embeds
        cached = request.model_state.get(_MM_KEY)
        if cached is None:
            cached = request.model_state[_MM_KEY] = self._encode_prompt_features(request)
        rows, features = cached
        span_rows = rows[start : min(end, num_prompt)]
        dst = torch.nonzero(span_rows >= 0).squeeze(1)  # CPU: no device sync
        if dst.numel():
            embeds[dst.to(embeds.device)] = features[span_rows[dst].to(features.device)].to(embeds.dtype)
        if end >= num_prompt:
            # Prompt done: free the encoder outputs (a recompute after preemption encodes again).
            del request.model_state[_MM_KEY]
        return embeds
