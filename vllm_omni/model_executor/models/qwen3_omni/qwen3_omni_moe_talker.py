"""Qwen3-Omni talker stage: the thinker's states -> RVQ codec frames, on our AR engine.

One engine step is one frame. The decoder (MoE with a gated shared expert in every layer,
interleaved M-RoPE) samples a frame's group-0 code through the engine's sampler; right after
sampling, `on_tokens_sampled` runs the code predictor on that row for groups 1..G-1 and builds
the frame's next input row, exactly as transformers' talker `generate` does between steps:

    next input = codec_embedding(group 0) + sum_j code_predictor.codec_embedding[j-1](group j)
                 + text stream row of this step (text_projection of the thinker reply), then tts_pad

The prompt follows `Qwen3OmniMoeForConditionalGeneration.generate`: the user turns of the
thinker prompt (text rows through `text_projection` of the thinker's input embeddings,
audio/image/video rows through `hidden_projection` of its `accept_hidden_layer` states), then
9 assistant rows = text [<|im_start|>, assistant, \\n, tts_pad x4, tts_bos, first reply token]
+ codec [0 x3, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos]. The text stream
is the rest of the reply, then tts_eos. Codes of the talker vocabulary's last 1024 ids except
codec EOS are suppressed (transformers' `suppress_tokens`); codec EOS ends the request.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from vllm_omni.model_executor.layers.linear import Linear, check_shape, set_loader
from vllm_omni.model_executor.layers.moe import SparseMoeBlock, map_expert_weight_name
from vllm_omni.model_executor.models.decoder import DecoderLayer, DecoderModel, GatedMLP, config_head_dim
from vllm_omni.model_executor.models.qwen3 import make_qwen3_attention
from vllm_omni.model_executor.models.qwen3_omni.deepstack import InterleavedMRotaryEmbedding
from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_code_predictor import Qwen3OmniMoeCodePredictor
from vllm_omni.model_executor.models.qwen3_omni.rope_index import GeneratedPositions
from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_talker_prompt import TalkerPrompt, talker_prompt
from vllm_omni.growing_tensor import GrowingTensor
from vllm_omni.model_executor.device_copy import HostCopy, to_device_nowait
from vllm_omni.model_executor.models.bridge_utils import StreamedRowsQueue, rows_like, streamed_rows
from vllm_omni.model_executor.models.stage_model import StageModel
from vllm_omni.model_executor.models.predictor_graphs import GraphedPredictor
from vllm_omni.model_executor.models.predictor_sampling import PredictorSampling
from vllm_omni.model_executor.models.utils import load_weights_strict, map_stacked_name
from vllm_omni.model_executor.models.qwen3_omni.bridges import CODES_KEY, TalkerInputs

_STATE_KEY = "qwen3_omni_talker"
_PREFIX = "talker."
_THINKER_EMBED_WEIGHTS = ("thinker.model.embed_tokens.weight", "thinker.model.language_model.embed_tokens.weight")
DEFAULT_SPEAKER = "Ethan"  # transformers' generate default
# transformers' code predictor sampling when the talker samples (greedy when it is greedy); the
# stage config's subtalker_sampling_params change it (predictor_sampling.py).
PREDICTOR_SAMPLING = PredictorSampling(temperature=1.0, top_k=50, top_p=0.8)
_NUM_SPECIAL_CODES = 1024  # the talker vocabulary's trailing control codes


class SharedExpertMoeBlock(SparseMoeBlock):
    """transformers' Qwen3OmniMoeTalkerTextSparseMoeBlock: routed experts + a shared expert
    scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                         config.num_experts_per_tok, config.norm_topk_prob, config.hidden_act)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act)
        self.shared_expert_gate = Linear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class ResizeMLP(nn.Module):
    """transformers' Qwen3OmniMoeTalkerResizeMLP: thinker width -> talker width."""

    def __init__(self, in_size: int, mid_size: int, out_size: int, hidden_act: str):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported talker hidden_act {hidden_act!r}; supported: ['silu']")
        self.linear_fc1 = Linear(in_size, mid_size, bias=True)
        self.linear_fc2 = Linear(mid_size, out_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


@dataclass(frozen=True)
class ParsedTalkerInputs:
    """A request's `model_inputs`: its thinker states and the talker prompt laid out from them,
    once at add_request (the layout is host work, ~1 ms a request: a burst of 32 arrivals paid
    it three times each before the talker's first step)."""

    inputs: TalkerInputs
    prompt: TalkerPrompt


@dataclass
class _RequestState:
    """Derived once per request (kept across preemption in model_state)."""

    prompt: TalkerPrompt
    prompt_embeds: torch.Tensor  # [P_t, H] talker input rows of the prompt
    # Text part of output token k's input row (k < T): the projected reply rows, then the
    # projected tts_eos once the thinker's reply is complete; tts_pad after that.
    text_stream: GrowingTensor
    text_pad: torch.Tensor  # [H]
    complete: bool  # the thinker's reply is all there (no more streamed rows)
    generated_positions: GeneratedPositions  # M-RoPE positions of output tokens
    codec_rows: list[torch.Tensor] = field(default_factory=list)  # codec part of output token k's row
    # Output token k's [G] codes: row i of a step's frames on their way to the host.
    frames: list[tuple[HostCopy, int]] = field(default_factory=list)
    frames_sent: int = 0  # frames handed out by request_outputs


class Qwen3OmniMoeTalkerForConditionalGeneration(StageModel):
    uses_mrope = True
    embeds_requests = True
    accepts_streamed_input = True  # the thinker's reply rows, as it generates them
    exports_hidden_states = False  # code2wav reads its codes
    has_code_predictor = True
    audio_seconds_per_token = 1 / 12.5  # a codec frame
    # The decode step (embeddings in, logits out) is graph-safe; the code predictor runs after it
    # (as its own graphs on CUDA: predictor_graphs.py).

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        tc, text = config.talker_config, config.talker_config.text_config
        self.full_config, self.config = config, tc
        self.model = DecoderModel(text, lambda i: DecoderLayer(text, make_qwen3_attention(text),
                                                               SharedExpertMoeBlock(text)))
        # transformers' talker rotary always interleaves M-RoPE, [24, 20, 20] unless configured; a
        # video at an odd frame rate gives float32 positions, whose angles it computes directly.
        self.model.rotary_emb = InterleavedMRotaryEmbedding(config_head_dim(text), text.rope_parameters,
                                                            text.max_position_embeddings)
        width = (tc.thinker_hidden_size, text.intermediate_size, text.hidden_size, text.hidden_act)
        self.text_projection, self.hidden_projection = ResizeMLP(*width), ResizeMLP(*width)
        self.codec_head = Linear(text.hidden_size, text.vocab_size)
        # transformers ties codec_head to the codec embedding by the talker config's flag.
        self.tie_word_embeddings = bool(getattr(tc, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.codec_head.weight = self.model.embed_tokens.weight
        self.code_predictor = Qwen3OmniMoeCodePredictor(tc.code_predictor_config)
        # Rows tts_bos, tts_eos, tts_pad of the thinker's embedding table.
        self.special_text_ids = [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]
        self.thinker_special_embeds = nn.Parameter(torch.empty(3, tc.thinker_hidden_size), requires_grad=False)
        set_loader(self.thinker_special_embeds, self._special_rows_loader)

        # Engine-facing attributes (DecoderForCausalLM's set).
        self.num_layers = text.num_hidden_layers
        self.num_kv_heads = text.num_key_value_heads
        self.head_dim = config_head_dim(text)
        self.hidden_size = text.hidden_size
        self.vocab_size = text.vocab_size
        self.max_position_embeddings = text.max_position_embeddings
        self.eos_token_ids = (tc.codec_eos_token_id,)
        suppressed = torch.zeros(text.vocab_size, dtype=torch.bool)
        suppressed[max(text.vocab_size - _NUM_SPECIAL_CODES, 0):] = True
        suppressed[tc.codec_eos_token_id] = False
        self.register_buffer("suppressed", suppressed, persistent=False)
        self.graphed_predictor = GraphedPredictor(self.code_predictor, text.hidden_size,
                                                  tc.code_predictor_config.vocab_size, PREDICTOR_SAMPLING)
        self._streamed = StreamedRowsQueue()  # the thinker's reply rows, projected at the next step

    # --- weights ----------------------------------------------------------------
    def _special_rows_loader(self, param: torch.Tensor, table: torch.Tensor, shard_id: Any = None) -> None:
        if shard_id is not None or table.dim() != 2 or max(self.special_text_ids) >= table.shape[0]:
            raise ValueError(f"thinker embedding table {tuple(table.shape)} lacks rows {self.special_text_ids}")
        rows = table[torch.tensor(self.special_text_ids, device=table.device)]
        check_shape("thinker_special_embeds", param.shape, rows)
        with torch.no_grad():
            param.copy_(rows)

    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        if name in _THINKER_EMBED_WEIGHTS:
            return "thinker_special_embeds", None
        if not name.startswith(_PREFIX) or "rotary_emb.inv_freq" in name:
            return None  # thinker.* / code2wav.*: other stages; inv_freq: derived
        name = name[len(_PREFIX):]
        if self.tie_word_embeddings and name == "codec_head.weight":
            return None  # the codec embedding is loaded into the shared parameter
        if name == "model.codec_embedding.weight":
            return "model.embed_tokens.weight", None
        return map_expert_weight_name(name) or map_stacked_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_strict(self, weights, self.map_weight_name)

    # --- forward ----------------------------------------------------------------
    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, *, inputs_embeds=None, capture_layers=()):
        if inputs_embeds is None:  # codec ids alone, without thinker conditioning (profiling)
            inputs_embeds = self.get_input_embeddings(input_ids)
        return self.model(None, positions, inputs_embeds, capture_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.codec_head.weight).float()
        return logits.masked_fill(self.suppressed, float("-inf"))

    def on_tokens_sampled(self, requests: list, hidden: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Model-runner hook after sampling: the rest of each sampled row's frame.

        hidden: [B, H] final states that produced the sampled group-0 codes `token_ids`. Runs
        the code predictor for all rows at once and keeps, per request, each frame's codes and
        the next step's input row (transformers builds it in `prepare_inputs_for_generation`).
        """
        first = self.model.embed_tokens(token_ids)
        codes, embeds = self.graphed_predictor.predict(requests, hidden, first)
        codec_rows = torch.cat([first[:, None], embeds], dim=1).sum(1)  # transformers' codec_hiddens.sum(1)
        frames = HostCopy(torch.cat([token_ids[:, None], codes], dim=1))  # read by request_outputs
        for i, req in enumerate(requests):
            st, k = self._state(req), req.num_output_tokens  # the engine appends the token after this hook
            del st.frames[k:], st.codec_rows[k:]
            st.codec_rows.append(codec_rows[i])
            st.frames.append((frames, i))

    def request_outputs(self, request, finished: bool) -> dict[str, torch.Tensor]:
        """{"code_predictor_codes": [frames, G] long}: the frames made since the previous call, one
        per sampled token except an EOS that ended the request (transformers never decodes it)."""
        st = request.model_state.get(_STATE_KEY)
        if st is None:
            return {}
        end = request.num_output_tokens
        if finished and end and request.output_token_ids[-1] in self.eos_token_ids \
                and not request.sampling_params.ignore_eos:
            end -= 1
        new, st.frames_sent = st.frames[st.frames_sent:end], max(st.frames_sent, end)
        if new:
            return {CODES_KEY: torch.stack([frames.get()[i] for frames, i in new])}
        return {CODES_KEY: torch.zeros(0, self.config.num_code_groups, dtype=torch.long)} if finished else {}

    def set_predictor_sampling(self, values) -> None:
        self.graphed_predictor.configure(PredictorSampling.parse(values, defaults=PREDICTOR_SAMPLING))

    def capture_graphs(self) -> None:
        self.graphed_predictor.capture(self.model.embed_tokens.weight)

    # --- per-request inputs (model runner / engine hooks) ------------------------
    def parse_request_inputs(self, info: Mapping[str, Any]) -> ParsedTalkerInputs:
        inputs = TalkerInputs.from_info(info)
        return ParsedTalkerInputs(inputs, self._prompt(inputs))  # layout errors fail this request alone

    def prompt_token_ids(self, prompt_token_ids: list[int], parsed: ParsedTalkerInputs) -> list[int]:
        """The talker's prompt length with codec pad ids: transformers' talker generates from
        embeddings alone, so no prompt id is penalized, and codec pad is suppressed anyway."""
        return [self.config.codec_pad_id] * parsed.prompt.num_tokens

    def embed_request_span(self, request, start: int, end: int, token_ids: torch.Tensor) -> torch.Tensor:
        """[end - start, hidden] input rows of talker positions start..end-1: output token k's row
        is its frame's codec row + the text stream's row k (transformers'
        prepare_inputs_for_generation)."""
        st = self._state(request)
        self._project_streamed_rows()
        num_prompt = st.prompt.num_tokens
        rows = [st.prompt_embeds[start:min(end, num_prompt)]]
        text = st.text_stream.view
        for k in range(max(start, num_prompt) - num_prompt, end - num_prompt):
            rows.append((st.codec_rows[k] + (text[k] if k < text.shape[0] else st.text_pad))[None])
        return torch.cat(rows)

    # --- streamed input: the thinker's reply rows as it generates them ---------------------
    def append_request_inputs(self, request, info: Mapping[str, Any], final: bool) -> None:
        """Rows of the thinker's reply ({"thinker_embeds": [n, E], "thinker_hidden": [n, E]};
        the talker reads only the embeddings past its prompt)."""
        st = self._state(request)
        if info:
            embeds, _ = streamed_rows(info, ("thinker_embeds", "thinker_hidden"), self.config.thinker_hidden_size)
        if info and embeds.shape[0]:
            # Projected at the next step with every request's new rows (transformers projects
            # the whole reply at once, which rounds differently in the last bits: docs/streaming.md).
            self._streamed.put(request, st.text_stream, (embeds,))
        if final:
            self._streamed.put_ready(request, st.text_stream, self._eos_row())
            st.complete = True

    def available_positions(self, request) -> int | None:
        st = self._state(request)
        return None if st.complete else st.prompt.num_tokens + len(st.text_stream) + self._streamed.num_rows(request)

    def _project_streamed_rows(self) -> None:
        self._streamed.flush(self.thinker_special_embeds, self.text_projection)

    def _eos_row(self) -> torch.Tensor:
        return self.text_projection(self.thinker_special_embeds)[1:2]

    def embed_request_spans(self, spans, token_ids: torch.Tensor) -> torch.Tensor:
        """A decode step's rows in three kernels for the whole batch (the rows of
        embed_request_span: each output token's codec row + its text row)."""
        states = [self._state(request) for request, _, _ in spans]
        self._project_streamed_rows()
        if not all(end == start + 1 and start >= st.prompt.num_tokens for (_, start, end), st in zip(spans, states)):
            return super().embed_request_spans(spans, token_ids)
        codec, text = [], []
        for (_, start, _), st in zip(spans, states):
            k = start - st.prompt.num_tokens
            codec.append(st.codec_rows[k])
            text.append(st.text_stream.view[k] if k < len(st.text_stream) else st.text_pad)
        return torch.stack(codec) + torch.stack(text)

    def decode_positions(self, request, position: int) -> tuple[int, int, int]:
        state = self._state(request)
        num_prompt = state.prompt.num_tokens
        if position < num_prompt:
            return super().decode_positions(request, position)
        values = state.generated_positions.at(position - num_prompt)
        self._check_position(request, max(values))
        return values

    def _check_position(self, request, position: float) -> None:
        if position >= self.model.rotary_emb.max_position:
            raise ValueError(f"request {request.request_id}: talker position {position} beyond the rotary table "
                             f"({self.model.rotary_emb.max_position})")

    def request_positions(self, request, start: int, end: int) -> torch.Tensor:
        """[3, end - start]: the prompt's M-RoPE positions; generated tokens continue each row
        from the last prompt position (+1 per step), as transformers' generate does."""
        state = self._state(request)
        positions = state.prompt.positions
        num_prompt = positions.shape[1]
        self._check_position(request, float(positions[:, -1].max()) + end - num_prompt)
        spans = [positions[:, start : min(end, num_prompt)]] if start < num_prompt else []
        if end > num_prompt:
            spans.append(state.generated_positions.span(max(start, num_prompt) - num_prompt, end - num_prompt))
        return torch.cat(spans, dim=1)

    def _state(self, request) -> _RequestState:
        state = request.model_state.get(_STATE_KEY)
        if state is None:
            state = request.model_state[_STATE_KEY] = self._build_state(request)
        return state

    def _prompt(self, inputs: TalkerInputs) -> TalkerPrompt:
        tc = self.config
        if inputs.thinker_hidden_layer is not None and inputs.thinker_hidden_layer != tc.accept_hidden_layer:
            raise ValueError(f"talker inputs carry thinker layer {inputs.thinker_hidden_layer}, but the talker "
                             f"reads accept_hidden_layer={tc.accept_hidden_layer}: export that layer from the thinker")
        if inputs.thinker_embeds.shape[1] != tc.thinker_hidden_size:
            raise ValueError(f"thinker states have width {inputs.thinker_embeds.shape[1]}, the talker expects "
                             f"thinker_hidden_size={tc.thinker_hidden_size}")
        prompt = talker_prompt(self.full_config, inputs, inputs.speaker or DEFAULT_SPEAKER)
        if float(prompt.positions.max()) + 1 >= self.model.rotary_emb.max_position:
            raise ValueError(f"talker M-RoPE position {float(prompt.positions.max())} beyond the rotary table "
                             f"({self.model.rotary_emb.max_position})")
        return prompt

    def _build_state(self, request) -> _RequestState:
        parsed: ParsedTalkerInputs = request.model_inputs
        inputs, prompt = parsed.inputs, parsed.prompt
        if request.num_prompt_tokens != prompt.num_tokens:
            raise ValueError(f"request {request.request_id}: talker prompt has {request.num_prompt_tokens} tokens, "
                             f"expected {prompt.num_tokens} (see prompt_token_ids)")
        # Built between steps (a streamed request's first rows arrive with its other messages), on
        # a GPU the other stages keep busy: nothing here may wait for it (tests/gpu/test_request_state_syncs.py).
        tc, weight = self.config, self.thinker_special_embeds
        embeds = rows_like(inputs.thinker_embeds, weight)
        num_prompt, mm = inputs.num_prompt_tokens, prompt.multimodal
        # transformers' _get_talker_user_parts over the whole thinker prompt, then the user turns
        # (row indices made on the host: a boolean mask on the GPU would wait for its count).
        user = torch.empty(num_prompt, self.hidden_size, device=weight.device, dtype=weight.dtype)
        if bool(mm.any()):
            host_rows = mm.nonzero().flatten()
            hidden = rows_like(inputs.thinker_hidden[host_rows], weight)
            user.index_copy_(0, to_device_nowait(host_rows, weight.device), self.hidden_projection(hidden))
        rows = to_device_nowait((~mm).nonzero().flatten(), weight.device)
        user.index_copy_(0, rows, self.text_projection(embeds.index_select(0, rows)))
        user = user.index_select(0, to_device_nowait(prompt.user_index, weight.device))
        # _get_talker_assistant_parts: rows from the assistant turn's <|im_start|> to the last reply row.
        assistant = self.text_projection(embeds[prompt.assistant_start:])
        bos, eos, pad = self.text_projection(weight).unbind(0)
        text = torch.cat([assistant[:3], pad.expand(4, -1), bos[None], assistant[3:4]])
        codec_ids = to_device_nowait(torch.tensor([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id,
                                                   prompt.speaker_id, tc.codec_pad_id, tc.codec_bos_id]), weight.device)
        codec = torch.cat([text.new_zeros(3, self.hidden_size), self.model.embed_tokens(codec_ids)])
        st = _RequestState(prompt=prompt, prompt_embeds=torch.cat([user, text + codec]),
                           text_stream=GrowingTensor(assistant[4:]), text_pad=pad, complete=False,
                           generated_positions=GeneratedPositions(prompt.positions[:, -1:]))
        if request.input_complete:  # the whole reply, projected at once as transformers does
            st.text_stream.append(eos[None])
            st.complete = True
        return st
