"""Qwen3-TTS talker stage: text (+ voice) -> RVQ codec frames, on our AR engine.

One engine step is one frame. The decoder (dense Qwen3 layers; its interleaved M-RoPE sees
three equal position rows for TTS, which is plain RoPE) samples a frame's group-0 code through
the engine's sampler; `on_tokens_sampled` then runs the code predictor for groups 1..G-1 and
builds the next input row, as qwen-tts' talker does between `generate` steps:

    next input = sum of the frame's code embeddings + text row k (text_feed.py: trailing
                 text row k, then tts_pad)

The prompt is laid out by prompt.py from the request's `TTSRequest` payload. Voice cloning
(Base checkpoints) embeds the reference audio here, on the stage's device: the speaker encoder
gives the voice row, the speech tokenizer's encoder the reference frames (in-context cloning);
a stored voice brings both, encoded when it was made (voice_encoder.py). A request's text may
stream in (the speech socket): its chunks extend the trailing text (`append_request_inputs`)
and the request computes as far as its text allows (`available_positions`).
Codes of the vocabulary's last 1024 ids except codec EOS are suppressed (qwen-tts'
`suppress_tokens`); codec EOS ends the request.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vllm_omni.model_executor.device_copy import HostCopy, to_device_nowait
from vllm_omni.model_executor.layers.linear import Linear, VocabEmbedding
from vllm_omni.model_executor.layers.rotary import get_rope
from vllm_omni.model_executor.models.decoder import DecoderModel, config_head_dim
from vllm_omni.model_executor.models.qwen3 import make_qwen3_layer
from vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_moe_talker import ResizeMLP
from vllm_omni.model_executor.models.qwen3_tts.code_predictor import Qwen3TTSCodePredictor
from vllm_omni.model_executor.models.qwen3_tts.configuration import TaskType, TTSConfig
from vllm_omni.model_executor.models.predictor_graphs import GraphedPredictor
from vllm_omni.model_executor.models.predictor_sampling import PredictorSampling
from vllm_omni.model_executor.models.qwen3_tts.prompt import TalkerPrompt, build_prompt, prompt_length
from vllm_omni.model_executor.models.qwen3_tts.reference_cache import ReferenceCache
from vllm_omni.model_executor.models.qwen3_tts.reference_graphs import REFERENCE_GRAPHS_ENV, ReferenceGraphs
from vllm_omni.model_executor.models.qwen3_tts.speaker_encoder import SpeakerEncoder
from vllm_omni.model_executor.models.qwen3_tts.speech_encoder import ENCODER_PREFIX, SpeechEncoder
from vllm_omni.model_executor.models.qwen3_tts.text_feed import TextFeed
from vllm_omni.model_executor.models.qwen3_tts.tts_request import CODES_KEY, REF_CODES_KEY, TTSRequest, text_ids_chunk
from vllm_omni.model_executor.models.stage_model import StageModel
from vllm_omni.model_executor.models.utils import load_weights_strict, map_stacked_name

_STATE_KEY = "qwen3_tts_talker"
_NUM_SPECIAL_CODES = 1024  # the talker vocabulary's trailing control codes
# qwen-tts' code predictor sampling (subtalker_*) when the talker samples; greedy when it is greedy
# (the stage config's subtalker_sampling_params change it: predictor_sampling.py).
PREDICTOR_SAMPLING = PredictorSampling(temperature=0.9, top_k=50, top_p=1.0)
SPEECH_TOKENIZER_DIR = "speech_tokenizer"


@dataclass
class _RequestState:
    prompt: TalkerPrompt
    text: TextFeed
    ref_codes: HostCopy | None  # [F, G] reference frames (in-context cloning), on their way to the host
    # Input row after output token k; None while its text has not arrived (codec row in `waiting`).
    frame_embeds: list[torch.Tensor | None] = field(default_factory=list)
    waiting: dict[int, torch.Tensor] = field(default_factory=dict)
    # Output token k's [G] codes: row i of a step's frames on their way to the host.
    frames: list[tuple[HostCopy, int]] = field(default_factory=list)
    frames_sent: int = 0  # frames handed out by request_outputs


def read_speech_tokenizer_config(model_dir: str) -> dict:
    path = Path(model_dir) / SPEECH_TOKENIZER_DIR / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir}: no {SPEECH_TOKENIZER_DIR}/config.json (the 12 Hz codec of Qwen3-TTS)")
    return json.loads(path.read_text())


class Qwen3TTSTalkerForConditionalGeneration(StageModel):
    embeds_requests = True
    accepts_streamed_input = True  # text that streams in (the speech socket)
    exports_hidden_states = False  # it exports its codes (request_outputs)
    has_code_predictor = True
    audio_seconds_per_token = 1 / 12.5  # a codec frame
    # The decode step (embeddings in, logits out) is graph-safe; the code predictor runs after it
    # (eagerly, or as its own graphs: predictor_graphs.py).

    def __init__(self, hf_config):
        super().__init__()
        config = TTSConfig.parse(hf_config)
        tc = config.talker
        self.full_config, self.config = config, tc
        self.model = DecoderModel(tc, lambda i: make_qwen3_layer(tc, i))
        self.model.rotary_emb = get_rope(config_head_dim(tc), tc.rope_parameters, tc.max_position_embeddings)
        self.text_embedding = VocabEmbedding(tc.text_vocab_size, tc.text_hidden_size)
        self.text_projection = ResizeMLP(tc.text_hidden_size, tc.text_hidden_size, tc.hidden_size, tc.hidden_act)
        self.codec_head = Linear(tc.hidden_size, tc.vocab_size)
        self.code_predictor = Qwen3TTSCodePredictor(tc.code_predictor, tc.hidden_size)
        self.special_text_ids = (config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id)
        self.is_base = config.task_type is TaskType.BASE
        self.speaker_encoder = SpeakerEncoder(config.speaker_encoder) if self.is_base else None
        self.speech_encoder: SpeechEncoder | None = None
        self.samples_per_frame = 1920
        if self.is_base:
            speech = read_speech_tokenizer_config(config.model_dir)
            self.samples_per_frame = speech["encode_downsample_rate"]
            # Kept out of the module tree: its tensors live in their own file (load_weights).
            object.__setattr__(self, "speech_encoder", SpeechEncoder(
                speech["encoder_config"], speech["encoder_valid_num_quantizers"], self.samples_per_frame))
            self.reference_cache = ReferenceCache(self._embed_speaker, self._encode_reference_codes)
        self.reference_graphs: ReferenceGraphs | None = None  # capture_graphs, on CUDA

        # Engine-facing attributes (DecoderForCausalLM's set).
        self.num_layers = tc.num_hidden_layers
        self.num_kv_heads = tc.num_key_value_heads
        self.head_dim = config_head_dim(tc)
        self.hidden_size = tc.hidden_size
        self.vocab_size = tc.vocab_size
        self.max_position_embeddings = tc.max_position_embeddings
        self.eos_token_ids = (tc.codec_eos_token_id,)
        suppressed = torch.zeros(tc.vocab_size, dtype=torch.bool)
        suppressed[max(tc.vocab_size - _NUM_SPECIAL_CODES, 0):] = True
        suppressed[tc.codec_eos_token_id] = False
        self.register_buffer("suppressed", suppressed, persistent=False)
        self.graphed_predictor = GraphedPredictor(self.code_predictor, self.hidden_size,
                                                  self.config.code_predictor.vocab_size, PREDICTOR_SAMPLING)

    # --- weights ----------------------------------------------------------------
    def map_weight_name(self, name: str) -> tuple[str, object] | None:
        if name.startswith("speaker_encoder."):
            return (name, None) if self.is_base else None
        if not name.startswith("talker.") or "rotary_emb.inv_freq" in name:
            return None
        name = name[len("talker."):]
        if name == "model.codec_embedding.weight":
            return "model.embed_tokens.weight", None
        if name == "model.text_embedding.weight":
            return "text_embedding.weight", None
        return map_stacked_name(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_weights_strict(self, weights, self.map_weight_name)
        if self.speech_encoder is not None:
            from safetensors.torch import load_file

            path = Path(self.full_config.model_dir) / SPEECH_TOKENIZER_DIR / "model.safetensors"
            tensors = {k[len(ENCODER_PREFIX):]: v for k, v in load_file(str(path)).items()
                       if k.startswith(ENCODER_PREFIX)}
            self.speech_encoder.load_released(tensors)
            self.speech_encoder.eval()
        return loaded

    def set_predictor_sampling(self, values) -> None:
        self.graphed_predictor.configure(PredictorSampling.parse(values, defaults=PREDICTOR_SAMPLING))

    def capture_graphs(self) -> None:
        self.graphed_predictor.capture(self.model.embed_tokens.weight)
        if self.speech_encoder is not None and self.speech_encoder.supports_padding() \
                and os.environ.get(REFERENCE_GRAPHS_ENV) != "0":
            self.reference_graphs = ReferenceGraphs(self.speaker_encoder, self.speech_encoder)
            self.reference_graphs.capture()

    def _embed_speaker(self, audio: torch.Tensor) -> torch.Tensor:
        row = self.reference_graphs.embed_speaker(audio) if self.reference_graphs else None
        return self.speaker_encoder.embed(audio) if row is None else row

    def _encode_reference_codes(self, audio: torch.Tensor) -> torch.Tensor:
        codes = self.reference_graphs.encode_codes(audio) if self.reference_graphs else None
        return self.speech_encoder.encode(audio) if codes is None else codes

    # --- forward ----------------------------------------------------------------
    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, *, inputs_embeds=None, capture_layers=()):
        if inputs_embeds is None:  # codec ids alone (profiling)
            inputs_embeds = self.get_input_embeddings(input_ids)
        return self.model(None, positions, inputs_embeds, capture_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.codec_head.weight).float()
        return logits.masked_fill(self.suppressed, float("-inf"))

    def on_tokens_sampled(self, requests: list, hidden: torch.Tensor, token_ids: torch.Tensor) -> None:
        """After sampling: groups 1..G-1 of each sampled frame and the next step's input row.
        hidden: [B, H] final states that produced the sampled group-0 codes `token_ids`."""
        first = self.model.embed_tokens(token_ids)
        codes, embeds = self.graphed_predictor.predict(requests, hidden, first)
        codec_rows = torch.cat([first[:, None], embeds], dim=1).sum(1)  # qwen-tts' codec_hiddens.sum(1)
        frames = HostCopy(torch.cat([token_ids[:, None], codes], dim=1))  # read by request_outputs
        for i, req in enumerate(requests):
            st, k = self._state(req), req.num_output_tokens  # the engine appends the token after this hook
            del st.frames[k:], st.frame_embeds[k:]
            st.waiting = {j: row for j, row in st.waiting.items() if j < k}
            if st.text.can_read(k):
                st.frame_embeds.append(codec_rows[i] + st.text.row(k))
            else:  # its text has not arrived: added when the row is needed (available_positions)
                st.frame_embeds.append(None)
                st.waiting[k] = codec_rows[i]
            st.frames.append((frames, i))

    def request_outputs(self, request, finished: bool) -> dict[str, torch.Tensor]:
        """{"codec_codes": [frames, G]}: the frames made since the previous call, one per sampled
        token except an EOS that ended the request; with the first, for in-context cloning, the
        reference's frames {"ref_codes": [F, G]}."""
        st = request.model_state.get(_STATE_KEY)
        if st is None:
            return {}
        end = request.num_output_tokens
        if finished and end and request.output_token_ids[-1] in self.eos_token_ids \
                and not request.sampling_params.ignore_eos:
            end -= 1
        new, first = st.frames[st.frames_sent:end], st.frames_sent == 0
        st.frames_sent = max(st.frames_sent, end)
        out = {}
        if new or finished:
            out[CODES_KEY] = torch.stack([frames.get()[i] for frames, i in new]) if new else \
                torch.zeros(0, self.config.num_code_groups, dtype=torch.long)
        if first and out and st.ref_codes is not None:  # copied at the prefill: no wait
            out[REF_CODES_KEY] = st.ref_codes.get()
        return out

    # --- per-request inputs (model runner / engine hooks) ------------------------
    def parse_request_inputs(self, info: Mapping[str, Any]) -> TTSRequest:
        return self._request(info)

    def prompt_token_ids(self, prompt_token_ids: list[int], request: TTSRequest) -> list[int]:
        """The talker prompt's length in codec pad ids: qwen-tts generates from embeddings alone,
        so no prompt id is penalized (codec pad is suppressed anyway)."""
        ref_frames = 0
        if request.ref_codes is not None:
            ref_frames = request.ref_codes.shape[0]
        elif request.in_context:
            ref_frames = -(-request.ref_audio.shape[0] // self.samples_per_frame)
        return [self.config.codec_pad_id] * prompt_length(self.config, request, ref_frames)

    def embed_request_span(self, request, start: int, end: int, token_ids: torch.Tensor) -> torch.Tensor:
        """[end - start, hidden] input rows of talker positions start..end-1."""
        st = self._state(request)
        num_prompt = st.prompt.rows.shape[0]
        rows = [st.prompt.rows[start:min(end, num_prompt)]]
        rows.extend(self._frame_row(st, k - num_prompt)[None] for k in range(max(start, num_prompt), end))
        return torch.cat(rows)

    def embed_request_spans(self, spans, token_ids: torch.Tensor) -> torch.Tensor:
        """A decode step's rows (each the previous frame's input row) in one kernel for the batch."""
        states = [self._state(request) for request, _, _ in spans]
        if not all(end == start + 1 and start >= st.prompt.rows.shape[0] for (_, start, end), st in zip(spans, states)):
            return super().embed_request_spans(spans, token_ids)
        return torch.stack([self._frame_row(st, start - st.prompt.rows.shape[0])
                            for (_, start, _), st in zip(spans, states)])

    @staticmethod
    def _frame_row(st: _RequestState, k: int) -> torch.Tensor:
        row = st.frame_embeds[k]
        if row is None:
            row = st.frame_embeds[k] = st.waiting.pop(k) + st.text.row(k)
        return row

    # --- streamed text (the speech socket) ----------------------------------------
    def append_request_inputs(self, request, info: Mapping[str, Any], final: bool) -> None:
        """More text for a request whose text streams in: {"streamed_text_ids": [ids]}."""
        st = self._state(request)
        ids = text_ids_chunk(info) if info else []
        with torch.inference_mode():
            rows = self._text_rows(ids) if ids else st.prompt.trailing[:0]
            st.text.append(rows, final, st.prompt.eos)

    def available_positions(self, request) -> int | None:
        st = self._state(request)
        frames = st.text.decidable()
        return None if frames is None else st.prompt.rows.shape[0] + frames

    def _request(self, info: Mapping[str, Any]) -> TTSRequest:
        request = TTSRequest.from_info(info)
        tc = self.config
        if request.speaker is not None and request.speaker not in tc.spk_id:
            raise ValueError(f"unknown speaker {request.speaker!r}; available: {sorted(tc.spk_id)}")
        if request.language != "auto" and request.language not in tc.codec_language_id:
            raise ValueError(f"unsupported language {request.language!r}; supported: "
                             f"{['auto', *sorted(k for k in tc.codec_language_id if 'dialect' not in k)]}")
        if request.clones and not self.is_base:
            raise ValueError("voice cloning (ref_audio, a stored voice) needs a Base checkpoint")
        if request.ref_speaker is not None and request.ref_speaker.shape[0] != tc.hidden_size:
            raise ValueError(f"the stored voice's speaker row has {request.ref_speaker.shape[0]} values; this "
                             f"talker's are {tc.hidden_size} wide (a voice of another checkpoint)")
        if request.ref_codes is not None and request.ref_codes.shape[1] != tc.num_code_groups:
            raise ValueError(f"the stored voice's codes have {request.ref_codes.shape[1]} groups; this talker "
                             f"reads {tc.num_code_groups}")
        return request

    def _state(self, request) -> _RequestState:
        state = request.model_state.get(_STATE_KEY)
        if state is None:
            state = request.model_state[_STATE_KEY] = self._build_state(request)
        return state

    @torch.inference_mode()
    def _build_state(self, request) -> _RequestState:
        tts: TTSRequest = request.model_inputs
        device = self.codec_head.weight.device
        speaker, ref_codes, ref_rows = None, None, None
        if tts.speaker is not None:
            speaker = self._codec_rows([self.config.spk_id[tts.speaker]])[0]
        if tts.ref_audio is not None:
            reference = self.reference_cache.encode(tts.ref_audio, with_codes=tts.in_context)
            speaker = reference.speaker
            # (an x-vector-only request ignores codes another request cached)
            ref_codes = reference.codes if tts.in_context else None
        elif tts.ref_speaker is not None:  # a stored voice: encoded when it was made
            speaker = tts.ref_speaker.to(device=device, dtype=self.codec_head.weight.dtype)
            ref_codes = None if tts.ref_codes is None else to_device_nowait(tts.ref_codes.long(), device)
        if ref_codes is not None:
            ref_rows = self.code_predictor.embed_codes(ref_codes, self.model.embed_tokens)
        prompt = build_prompt(self.config, self.special_text_ids, tts, self._text_rows, self._codec_rows,
                              speaker, ref_rows)
        if prompt.rows.shape[0] != request.num_prompt_tokens:
            raise ValueError(f"request {request.request_id}: talker prompt has {prompt.rows.shape[0]} rows, "
                             f"expected {request.num_prompt_tokens} (see prompt_token_ids)")
        text = TextFeed(prompt.trailing, prompt.pad, tts.text_complete, prompt.text_read, tts.max_frames_per_token)
        return _RequestState(prompt=prompt, text=text, ref_codes=None if ref_codes is None else HostCopy(ref_codes))

    def _text_rows(self, ids: list[int]) -> torch.Tensor:
        return self.text_projection(self.text_embedding(self._on_device(ids)))

    def _codec_rows(self, ids: list[int]) -> torch.Tensor:
        return self.model.embed_tokens(self._on_device(ids))

    def _on_device(self, ids: list[int]) -> torch.Tensor:
        return to_device_nowait(torch.tensor(ids, dtype=torch.long), self.codec_head.weight.device)
