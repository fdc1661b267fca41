"""Qwen2.5-Omni talker stage: the thinker's states -> speech codec tokens, on our AR engine.

The decoder is the shared Qwen2 stack with M-RoPE. Its inputs follow transformers'
`Qwen2_5OmniForConditionalGeneration.generate` + `Qwen2_5OmniTalkerForConditionalGeneration`
exactly (P thinker prompt tokens, reply tokens g_0..g_{N-1}; r_j = thinker final hidden state
+ thinker input embedding of g_j, known for j < N-1):

    talker position   0..P-1             P                      P+1               P+2+k (decode)
    thinker side      hidden+embeds      embed(speaker bos)     r_0               stream[k]
    codec side        (none)             codec(pad)             codec(bos)        codec(sampled)

with the prompt's audio/image/video placeholder embeddings zeroed, stream = r_1.. r_{N-2},
embed(text eos), embed(text pad), and text pad repeated once the stream runs out. Every row
then goes through `thinker_to_talker_proj`. Positions are the thinker prompt's M-RoPE
positions, then text positions. "embed" is the thinker's token table: the talker keeps only
the rows it needs (speaker bos tokens, text eos/pad) from `thinker.model.embed_tokens`.

Generation as in transformers: the codec bos token is never sampled, and codec end or codec
pad ends the speech (`eos_token_ids`, which the engine prefers over the tokenizer's).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from vllm_omni.model_executor.device_copy import to_device_nowait
from vllm_omni.model_executor.layers.linear import Linear, VocabEmbedding, check_shape, set_loader
from vllm_omni.model_executor.models.decoder import DecoderModel, config_head_dim
from vllm_omni.model_executor.models.qwen2 import make_qwen2_layer
from vllm_omni.model_executor.models.qwen2_5_omni.positions import MRopeTokenConfig, omni_rope_index
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav import load_speakers, select_speaker
from vllm_omni.growing_tensor import GrowingTensor
from vllm_omni.model_executor.models.bridge_utils import StreamedRowsQueue, rows_like, streamed_rows
from vllm_omni.model_executor.models.stage_model import StageModel
from vllm_omni.model_executor.models.utils import load_weights_strict, map_stacked_name
from vllm_omni.model_executor.models.qwen2_5_omni.bridges import TalkerInputs

_STATE_KEY = "qwen2_5_omni_talker"
# Saved checkpoints; transformers 5's in-memory layout (accepted in case one was saved so).
_THINKER_EMBED_WEIGHTS = ("thinker.model.embed_tokens.weight", "thinker.model.language_model.embed_tokens.weight")
_PREFIX = "talker."


@dataclass
class _RequestState:
    """Derived once per request from its inputs (kept across preemption in model_state)."""

    # Thinker-side row of each position: P prompt rows, speaker bos, r_0.. r_{R-1}, and once the
    # thinker's reply is complete, text eos and text pad (the last row repeats).
    conditioning: GrowingTensor
    complete: bool  # the thinker's reply is all there (no more streamed rows)
    prompt_positions: torch.Tensor  # [3, P] long, CPU
    delta: int  # position of token i >= P is i + delta
    num_prompt: int  # P


class Qwen2_5OmniTalkerForConditionalGeneration(StageModel):
    uses_mrope = True
    embeds_requests = True
    accepts_streamed_input = True  # the thinker's reply rows, as it generates them
    audio_seconds_per_token = 1 / 50  # a codec code (token2wav: 50 codes a second)
    exports_hidden_states = False  # code2wav reads its codes


    def __init__(self, config: PretrainedConfig):
        super().__init__()
        tc = config.talker_config
        thinker = config.thinker_config
        if tc.embedding_size != thinker.text_config.hidden_size:
            raise ValueError(f"talker embedding_size {tc.embedding_size} != thinker hidden size "
                             f"{thinker.text_config.hidden_size}")
        self.config = tc
        self.model = DecoderModel(tc, lambda i: make_qwen2_layer(tc, i))
        # Codec ids are embedded in the thinker's width and projected with everything else.
        self.model.embed_tokens = VocabEmbedding(tc.vocab_size, tc.embedding_size)
        self.thinker_to_talker_proj = Linear(tc.embedding_size, tc.hidden_size, bias=True)
        self.codec_head = Linear(tc.hidden_size, tc.vocab_size)

        # Engine-facing attributes (DecoderForCausalLM's set); inputs_embeds are decoder-width.
        self.num_layers = tc.num_hidden_layers
        self.num_kv_heads = tc.num_key_value_heads
        self.head_dim = config_head_dim(tc)
        self.hidden_size = tc.hidden_size
        self.vocab_size = tc.vocab_size
        self.max_position_embeddings = tc.max_position_embeddings
        self.eos_token_ids = (tc.tts_codec_end_token_id, tc.tts_codec_pad_token_id)
        self.codec_pad, self.codec_bos = tc.tts_codec_pad_token_id, tc.tts_codec_start_token_id
        self.codec_mask = tc.tts_codec_mask_token_id
        self.rope_tokens = MRopeTokenConfig.from_config(tc)
        # HF zeroes the thinker embeddings of these prompt placeholders (their encoder features).
        self.placeholder_ids = torch.tensor(
            [thinker.audio_token_index, thinker.image_token_index, thinker.video_token_index], device="cpu")
        self.vision_ids = self.placeholder_ids[1:]

        # The checkpoint folder holds spk_dict.pt; AutoConfig.from_pretrained records the folder.
        self.speaker_bos = {name: s.bos_token for name, s in load_speakers(config.name_or_path).items()}
        text_ids = sorted({tc.tts_text_end_token_id, tc.tts_text_pad_token_id, *self.speaker_bos.values()})
        self.text_row = {token: row for row, token in enumerate(text_ids)}
        self.thinker_text_embeds = nn.Parameter(torch.empty(len(text_ids), tc.embedding_size), requires_grad=False)
        set_loader(self.thinker_text_embeds, self._text_rows_loader(text_ids))
        self._streamed = StreamedRowsQueue()  # the thinker's reply rows, added at the next step

    # --- weights ----------------------------------------------------------------
    @staticmethod
    def _text_rows_loader(text_ids: list[int]):
        def load(param: torch.Tensor, table: torch.Tensor, shard_id: Any = None) -> None:
            if shard_id is not None or table.dim() != 2 or max(text_ids) >= table.shape[0]:
                raise ValueError(f"thinker embedding table {tuple(table.shape)} lacks rows {text_ids}")
            rows = table[torch.tensor(text_ids, device=table.device)]
            check_shape("thinker_text_embeds", param.shape, rows)
            with torch.no_grad():
                param.copy_(rows)

        return load

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        if name in _THINKER_EMBED_WEIGHTS:
            return "thinker_text_embeds", None
        if not name.startswith(_PREFIX) or "rotary_emb.inv_freq" in name:
            return None  # thinker.* / token2wav.*: other stages; inv_freq: derived
        return map_stacked_name(name[len(_PREFIX):])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_strict(self, weights, self.map_weight_name)

    # --- forward ----------------------------------------------------------------
    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.thinker_to_talker_proj(self.model.embed_tokens(input_ids))

    def forward(self, input_ids, positions, *, inputs_embeds=None, capture_layers=()):
        if inputs_embeds is None:  # codec ids alone, without thinker conditioning
            inputs_embeds = self.get_input_embeddings(input_ids)
        return self.model(None, positions, inputs_embeds, capture_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.codec_head.weight).float()
        logits[:, self.codec_bos] = float("-inf")  # HF generate: suppress_tokens=[codec bos]
        return logits

    # --- per-request inputs (model runner / engine hooks) ------------------------
    def parse_request_inputs(self, info: Mapping[str, Any]) -> TalkerInputs:
        inputs = TalkerInputs.from_info(info)
        select_speaker(self.speaker_bos, inputs.speaker)
        self._prompt_positions(inputs)  # layout errors surface here, for this request alone
        return inputs

    def prompt_token_ids(self, prompt_token_ids: list[int], inputs: TalkerInputs) -> list[int]:
        """HF's talker prompt ids ([codec mask] * P + [codec pad, codec bos]); they matter for
        the repetition penalty."""
        num_prompt = inputs.num_prompt_tokens
        if len(prompt_token_ids) != num_prompt + 2:
            raise ValueError(f"talker prompt must have {num_prompt + 2} tokens (thinker prompt + 2), "
                             f"got {len(prompt_token_ids)}")
        return [self.codec_mask] * num_prompt + [self.codec_pad, self.codec_bos]

    def embed_request_span(self, request, start: int, end: int, token_ids: torch.Tensor) -> torch.Tensor:
        """[end - start, hidden] projected input rows of talker positions start..end-1."""
        st = self._state(request)
        self._add_streamed_rows()
        idx = torch.arange(start, end, device=token_ids.device)
        # Positions P and P+1 carry codec pad / bos whatever the prompt ids say; earlier
        # prompt positions have no codec part (HF never embeds its mask placeholders).
        codec_ids = torch.where(idx == st.num_prompt, self.codec_pad, token_ids)
        codec_ids = torch.where(idx == st.num_prompt + 1, self.codec_bos, codec_ids)
        codec_ids = torch.where(idx < st.num_prompt, self.codec_mask, codec_ids)
        conditioning = st.conditioning.view
        # Past the end only once complete (the pad row repeats); before that the engine
        # computes only positions below available_positions().
        rows = conditioning[idx.clamp(max=conditioning.shape[0] - 1)]
        rows = torch.where((idx >= st.num_prompt)[:, None], rows + self.model.embed_tokens(codec_ids), rows)
        return self.thinker_to_talker_proj(rows)

    def embed_request_spans(self, spans, token_ids: torch.Tensor) -> torch.Tensor:
        """A decode step's rows in four kernels for the whole batch: each row is the thinker row
        of its position (the last repeats once complete) + its code's embedding, projected."""
        states = [self._state(request) for request, _, _ in spans]
        self._add_streamed_rows()
        if not all(end == start + 1 and start >= st.num_prompt + 2 for (_, start, end), st in zip(spans, states)):
            return super().embed_request_spans(spans, token_ids)
        conditioning = torch.stack([st.conditioning.view[min(start, len(st.conditioning) - 1)]
                                    for (_, start, _), st in zip(spans, states)])
        return self.thinker_to_talker_proj(conditioning + self.model.embed_tokens(token_ids))

    def decode_positions(self, request, position: int) -> tuple[int, int, int]:
        st = self._state(request)
        if position < st.num_prompt:
            return super().decode_positions(request, position)
        self._check_position(request, position + st.delta)
        return (position + st.delta,) * 3

    def _check_position(self, request, position: int) -> None:
        if position >= self.model.rotary_emb.max_position:
            raise ValueError(f"request {request.request_id}: talker position {position} beyond the "
                             f"rotary table ({self.model.rotary_emb.max_position})")

    def request_positions(self, request, start: int, end: int) -> torch.Tensor:
        """[3, end - start]: the thinker prompt's M-RoPE positions, then text positions."""
        st = self._state(request)
        self._check_position(request, end - 1 + st.delta)
        positions = (torch.arange(start, end) + st.delta).view(1, -1).expand(3, -1).clone()
        if start < st.num_prompt:
            positions[:, : st.num_prompt - start] = st.prompt_positions[:, start : min(end, st.num_prompt)]
        return positions

    def _state(self, request) -> _RequestState:
        state = request.model_state.get(_STATE_KEY)
        if state is None:
            state = request.model_state[_STATE_KEY] = self._build_state(request)
        return state

    def _build_state(self, request) -> _RequestState:
        inputs: TalkerInputs = request.model_inputs
        num_prompt = inputs.num_prompt_tokens
        if request.num_prompt_tokens != num_prompt + 2:
            raise ValueError(f"request {request.request_id}: talker prompt has {request.num_prompt_tokens} tokens, "
                             f"expected {num_prompt + 2} (thinker prompt + speaker bos + first reply token)")
        # Built between steps (a streamed request's first rows arrive with its other messages), on
        # a GPU the other stages keep busy: nothing here may wait for it (tests/gpu/test_request_state_syncs.py).
        weight = self.thinker_text_embeds
        embeds, hidden = rows_like(inputs.thinker_embeds, weight), rows_like(inputs.thinker_hidden, weight)
        prompt_ids = torch.tensor(inputs.thinker_prompt_token_ids)
        placeholder = to_device_nowait(torch.isin(prompt_ids, self.placeholder_ids), weight.device)
        prompt_rows = hidden[:num_prompt] + embeds[:num_prompt].masked_fill(placeholder[:, None], 0.0)
        reply_rows = hidden[num_prompt:] + embeds[num_prompt:]
        bos = self.text_row[self.speaker_bos[select_speaker(self.speaker_bos, inputs.speaker)]]
        conditioning = GrowingTensor(torch.cat([prompt_rows, weight[bos : bos + 1], reply_rows]))
        positions, delta = self._prompt_positions(inputs)
        st = _RequestState(conditioning, False, positions, delta, num_prompt)
        if request.input_complete:
            self._complete(request, st)
        return st

    def _complete(self, request, st: _RequestState) -> None:
        # With R = 0 (a one-token reply, which transformers cannot handle) the stream simply
        # starts with the text eos.
        weight = self.thinker_text_embeds
        eos, pad = self.text_row[self.config.tts_text_end_token_id], self.text_row[self.config.tts_text_pad_token_id]
        self._streamed.put_ready(request, st.conditioning, torch.cat([weight[eos : eos + 1], weight[pad : pad + 1]]))
        st.complete = True

    # --- streamed input: the thinker's reply rows as it generates them ---------------------
    def append_request_inputs(self, request, info: Mapping[str, Any], final: bool) -> None:
        """Rows of the thinker's reply ({"thinker_embeds": [n, E], "thinker_hidden": [n, E]})."""
        st = self._state(request)
        if info:
            embeds, hidden = streamed_rows(info, ("thinker_embeds", "thinker_hidden"), st.conditioning.view.shape[1])
        if info and embeds.shape[0]:  # hidden + embeds at the next step, with every request's new rows
            self._streamed.put(request, st.conditioning, (hidden, embeds))
        if final:
            self._complete(request, st)

    def available_positions(self, request) -> int | None:
        st = self._state(request)
        return None if st.complete else len(st.conditioning) + self._streamed.num_rows(request)

    def _add_streamed_rows(self) -> None:
        self._streamed.flush(self.thinker_text_embeds, torch.add)

    def _check_layout(self, inputs: TalkerInputs) -> None:
        has_vision = bool(torch.isin(torch.tensor(inputs.thinker_prompt_token_ids), self.vision_ids).any())
        if has_vision and inputs.image_grid_thw is None and inputs.video_grid_thw is None:
            raise ValueError("the thinker prompt has image/video placeholders but the talker inputs carry no "
                             "image_grid_thw / video_grid_thw, which its M-RoPE positions depend on")

    def _prompt_positions(self, inputs: TalkerInputs) -> tuple[torch.Tensor, int]:
        self._check_layout(inputs)
        # HF runs get_rope_index on [thinker prompt, speaker bos, g_0]; the two trailing text
        # tokens only continue the prompt's positions, which `delta` does.
        positions, delta = omni_rope_index(
            inputs.thinker_prompt_token_ids,
            self.rope_tokens,
            image_grid_thw=inputs.image_grid_thw,
            video_grid_thw=inputs.video_grid_thw,
            audio_seqlens=inputs.audio_feature_lengths,
            second_per_grids=inputs.video_second_per_grid,
            use_audio_in_video=inputs.use_audio_in_video,
        )
        if int(positions.max()) >= self.model.rotary_emb.max_position:
            raise ValueError(f"talker M-RoPE position {int(positions.max())} beyond the rotary table "
                             f"({self.model.rotary_emb.max_position})")
        return positions, delta
