"""Qwen2.5-Omni code2wav stage: codec codes + speaker -> 24 kHz waveform (DiT + BigVGAN).

A wrapper around transformers' `Qwen2_5OmniToken2WavModel` (DESIGN section 5), loaded from
the `token2wav.*` tensors of the full checkpoint, driven as `stage_io.StreamingGenerationModel`.
What differs from transformers' `forward`:

- The DiT's flow-matching ODE starts from noise drawn from each request's own seeded
  generator (`sampling_params.seed`), not the global RNG, so a waveform depends only on its
  request, never on what else shares the batch (token2wav_dit.py).
- Requests of different lengths, voices and seeds share one DiT batch: right padding with a
  mask that keeps real and padding positions apart. The vocoder has no such mask, so whole
  requests share a vocoder call only with requests of their own length.
- `open_stream` / `decode_streams` decode a request in chunks that follow the DiT's block
  attention, then vocode them with overlap-save (token2wav_stream.py, docs/streaming.md).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_omni.model_executor.model_loader import safetensors_files
from vllm_omni.model_executor.models.codec_streaming import (
    Precision, chunk_output, own_streams, plan_padded_calls, precision_scope, resolve_precision,
)
from vllm_omni.model_executor.models.qwen2_5_omni.bridges import Code2WavInputs
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_dit import (
    DiTRow, forward_cfg, prepare_for_cuda, sample_mel, speaker_features,
)
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_graphs import DiTGraphs, dit_graphs_enabled
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_noise import new_generator, settle_codes, whole_noise
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_stream import (
    StreamGeometry, Token2WavStream, Token2WavStreamConfig,
)
from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_vocoder import (
    check_vocoder, fuse_activations, receptive_field, vocode, vocode_windows,
)
from vllm_omni.stage_io import StageRequest, StreamingDecoder


SPEAKER_FILE = "spk_dict.pt"
DEFAULT_SPEAKER = "Chelsie"  # transformers' generate default
SAMPLE_RATE = 24000
WEIGHT_PREFIX = "token2wav."
DEFAULT_NUM_STEPS = 10  # transformers' Qwen2_5OmniToken2WavModel.forward default
# Padding a DiT row by this many mel frames costs about one more batched ODE solve (its
# launches: 36 evaluations x 22 layers), so rows closer in length than that share a call.
DIT_CALL_COST_FRAMES = 1024


@dataclass(frozen=True)
class Speaker:
    bos_token: int  # thinker-vocabulary token the talker starts its text stream with
    cond: torch.Tensor  # [1, enc_emb_dim] speaker embedding
    ref_mel: torch.Tensor  # [1, frames, mel_dim] reference mel spectrogram


def load_speakers(model_dir: str | Path) -> dict[str, Speaker]:
    """The voices of a Qwen2.5-Omni checkpoint (`spk_dict.pt`, required like in transformers)."""
    path = Path(model_dir) / SPEAKER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a Qwen2.5-Omni checkpoint needs {SPEAKER_FILE} for its voices")
    raw = torch.load(path, map_location="cpu", weights_only=True)
    return {name: Speaker(int(v["bos_token"]), v["cond"], v["ref_mel"]) for name, v in raw.items()}


def select_speaker(speakers: Mapping[str, Any], name: str | None) -> str:
    """The voice to use (transformers' default when None); ValueError for an unknown one."""
    name = DEFAULT_SPEAKER if name is None else name
    if name not in speakers:
        raise ValueError(f"unknown speaker {name!r}; available: {sorted(speakers)}")
    return name


class Qwen2_5OmniToken2Wav:
    """StreamingGenerationModel for the `code2wav` stage; each result is {"audio": float32 [N],
    "sample_rate": int32 []} (a stream's chunks carry the rate in the first one only)."""

    stream_options_type = Token2WavStreamConfig  # load(stream_config=...) from the input connector's options

    def __init__(self, module: torch.nn.Module, speakers: dict[str, Speaker], device: torch.device,
                 num_steps: int = DEFAULT_NUM_STEPS, precision: Precision = Precision.FLOAT32,
                 stream_config: Token2WavStreamConfig | None = None, compile_mode: str | None = None) -> None:
        self.module = module
        self.dit = module.code2wav_dit_model
        self.bigvgan = module.code2wav_bigvgan_model
        self.speakers = speakers
        self.device = device
        self.num_steps = num_steps
        self.precision = precision
        self.sample_rate = SAMPLE_RATE
        check_vocoder(self.bigvgan)
        self.stream_geometry = geo = self._geometry(stream_config or Token2WavStreamConfig())
        # A chunk's blocks and its look-ahead, in codes, and the codes more a chunk waits for.
        blocks = max(geo.config.initial_chunk_blocks, geo.config.chunk_blocks) + geo.config.future_blocks
        self.max_units_per_chunk = -(-blocks * geo.block_frames // geo.repeats) + geo.settle_codes
        self._speaker_features: dict[str, torch.Tensor] = {}
        if device.type == "cuda":
            prepare_for_cuda(self.dit, bf16=precision is Precision.BFLOAT16)
            fuse_activations(self.bigvgan)
        # On CUDA the DiT evaluation replays CUDA graphs, one per shape (token2wav_graphs.py).
        # Benchmark option: torch.compile it instead (static shapes: each new one compiles once).
        self._dit_forward = DiTGraphs() if dit_graphs_enabled(device) else forward_cfg
        if compile_mode is not None:
            self._dit_forward = torch.compile(forward_cfg, mode=compile_mode, dynamic=False)

    @classmethod
    def load(cls, model_path: str, *, model_stage: str | None = None, device: torch.device | str = "cpu",
             dtype: str = "auto", num_steps: int = DEFAULT_NUM_STEPS, load_format: str = "auto",
             precision: str | None = None, stream_config: Token2WavStreamConfig | None = None,
             compile_mode: str | None = None) -> Qwen2_5OmniToken2Wav:
        from transformers import AutoConfig
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

        # Weights stay float32 (transformers casts token2wav to float32 too: the ODE and the
        # vocoder lose too much in half precision); bfloat16 / tf32 change only how it computes.
        device = torch.device(device)
        # In float32 the DiT is compute-bound at the FP32 peak (13x over its target). On CUDA the
        # default runs its evaluations in bfloat16 (the ODE state and the vocoder stay float32 /
        # TF32): 1.5x faster than TF32 at 8 streams, 52 dB against float32 (TF32: 55 dB).
        mode = resolve_precision(dtype, precision, device, cuda_auto=Precision.BFLOAT16)
        config = AutoConfig.from_pretrained(model_path)
        t2w_config = getattr(config, "token2wav_config", None)
        if t2w_config is None:
            raise ValueError(f"{model_path}: config has no token2wav_config (not a Qwen2.5-Omni checkpoint?)")
        with torch.device(device):  # random init (overwritten below) is much faster on a GPU
            module = Qwen2_5OmniToken2WavModel(t2w_config).float()
        if load_format != "dummy":  # dummy: keep the random init (benchmarks)
            # from_pretrained would not strip the `token2wav.` prefix of the full checkpoint.
            module.load_state_dict(_prefixed_tensors(model_path, WEIGHT_PREFIX), strict=True)
        return cls(module.eval(), load_speakers(model_path), device, num_steps, mode, stream_config, compile_mode)

    def _geometry(self, config: Token2WavStreamConfig) -> StreamGeometry:
        """The stream config with its checkpoint-derived defaults filled in."""
        dit_config = self.dit.config
        if dit_config.block_size % self.dit.repeats:
            raise ValueError(f"token2wav: DiT block_size {dit_config.block_size} is not a whole number of codes "
                             f"({self.dit.repeats} mel frames each)")
        resolved = dataclasses.replace(
            config,
            past_blocks=len(dit_config.look_backward_layers) if config.past_blocks is None else config.past_blocks,
            future_blocks=len(dit_config.look_ahead_layers) if config.future_blocks is None else config.future_blocks,
            vocoder_context_frames=(receptive_field(self.bigvgan) if config.vocoder_context_frames is None
                                    else config.vocoder_context_frames))
        return StreamGeometry(resolved, dit_config.block_size, self.dit.repeats, self.dit.mel_dim,
                              dit_config.num_embeds, settle_codes(self.dit.repeats, self.dit.mel_dim))

    # ------------------------------------------------------------------ whole requests
    @torch.inference_mode()
    def generate_batch(self, inputs: list[StageRequest]) -> list[dict[str, torch.Tensor]]:
        jobs = [self._job(req) for req in inputs]
        live = [i for i, job in enumerate(jobs) if job.codes.numel()]
        mels = self._sample_mels([(self._dit_row(jobs[i].speaker, jobs[i].codes, self._whole_noise(jobs[i])),
                                   jobs[i].num_steps) for i in live])
        wavs: list[torch.Tensor] = [torch.zeros(0)] * len(jobs)
        for i, wav in zip(live, self._vocode_whole(mels)):
            wavs[i] = wav
        # The rate travels with the audio so that callers (CLI, server) can encode it without
        # knowing the model; a 0-dim tensor is metadata, replaced rather than concatenated.
        rate = torch.tensor(self.sample_rate, dtype=torch.int32)
        return [{"audio": wav, "sample_rate": rate} for wav in wavs]

    def _job(self, req: StageRequest) -> _Job:
        inputs = Code2WavInputs.from_info(req.additional_information)
        num_steps = self.num_steps if inputs.num_steps is None else inputs.num_steps
        speaker = select_speaker(self.speakers, inputs.speaker)
        codes = torch.tensor(req.prompt_token_ids, dtype=torch.long)
        if codes.numel() and not (0 <= int(codes.min()) and int(codes.max()) <= self.dit.config.num_embeds):
            raise ValueError(f"request {req.request_id}: codec codes must lie in [0, {self.dit.config.num_embeds}]")
        if codes.numel() * self.dit.repeats > self.dit.config.max_position_embeddings:
            raise ValueError(f"request {req.request_id}: {codes.numel()} codes exceed the DiT's "
                             f"{self.dit.config.max_position_embeddings // self.dit.repeats}-code limit")
        if num_steps < 2:
            raise ValueError(f"request {req.request_id}: num_steps must be >= 2, got {num_steps}")
        return _Job(codes, speaker, num_steps, req.sampling_params.seed)

    def _whole_noise(self, job: _Job) -> torch.Tensor:
        return whole_noise(new_generator(job.seed), job.codes.numel() * self.dit.repeats, self.dit.mel_dim)

    def _vocode_whole(self, mels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Whole mels [frames, mel_dim] -> waveforms; only mels of one length share a call (the
        vocoder's edges see its padding)."""
        wavs: list[torch.Tensor] = [torch.zeros(0)] * len(mels)
        for length in sorted({mel.shape[0] for mel in mels}):
            group = [i for i, mel in enumerate(mels) if mel.shape[0] == length]
            with precision_scope(self.device, tf32=self.precision is not Precision.FLOAT32):
                batch = vocode(self.bigvgan, torch.stack([mels[i].T for i in group]).to(self.device))
            for slot, i in enumerate(group):
                wavs[i] = batch[slot]
        return wavs

    # ------------------------------------------------------------------ streaming
    def open_stream(self, req: StageRequest) -> Token2WavStream:
        job = self._job(req)
        stream = Token2WavStream(req.request_id, job.speaker, job.num_steps, job.seed, self.stream_geometry)
        if job.codes.numel():
            stream.push(job.codes, final=False)
        return stream

    @torch.inference_mode()
    def decode_streams(self, decoders: list[StreamingDecoder]) -> list[dict[str, torch.Tensor]]:
        streams = own_streams(decoders, Token2WavStream)
        windows = [s.next_dit_window() for s in streams]
        mels = self._sample_mels([(self._dit_row(s.speaker, w.codes, w.noise), s.num_steps)
                                  for s, w in zip(streams, windows)])
        voc_windows = [s.vocoder_window(w, mel) for s, w, mel in zip(streams, windows, mels)]
        with precision_scope(self.device, tf32=self.precision is not Precision.FLOAT32):
            audio = vocode_windows(self.bigvgan, voc_windows, self.device)
        # Only now the streams move on: a call that failed left them as they were (the engine
        # retries a failed batch's streams one by one).
        for stream, window, voc_window in zip(streams, windows, voc_windows):
            stream.commit(window, voc_window)
        return [chunk_output(stream, wav, self.sample_rate) for stream, wav in zip(streams, audio)]

    # ------------------------------------------------------------------ the DiT
    def _dit_row(self, speaker: str, codes: torch.Tensor, noise: torch.Tensor) -> DiTRow:
        voice = self.speakers[speaker]
        if speaker not in self._speaker_features:
            with precision_scope(self.device, tf32=False):
                self._speaker_features[speaker] = speaker_features(
                    self.dit, voice.ref_mel.to(self.device, torch.float32)).cpu()
        return DiTRow(codes=codes, noise=noise, speaker_embedding=voice.cond[0].float(),
                      speaker_features=self._speaker_features[speaker])

    def _sample_mels(self, rows: list[tuple[DiTRow, int]]) -> list[torch.Tensor]:
        """Each row's mel [frames, mel_dim]: one batched ODE per call that `plan_padded_calls`
        forms among the rows sharing a step count."""
        mels: list[torch.Tensor] = [torch.zeros(0)] * len(rows)
        for num_steps in sorted({steps for _, steps in rows}):
            members = [i for i, (_, steps) in enumerate(rows) if steps == num_steps]
            lengths = [rows[i][0].noise.shape[0] for i in members]
            for call in plan_padded_calls(lengths, DIT_CALL_COST_FRAMES):
                batch = [members[j] for j in call]
                with precision_scope(self.device, tf32=self.precision is Precision.TF32):
                    out = sample_mel(self.dit, [rows[i][0] for i in batch], num_steps, self.device,
                                     bf16=self.precision is Precision.BFLOAT16, forward=self._dit_forward)
                for i, mel in zip(batch, out):
                    mels[i] = mel
        return mels


def _prefixed_tensors(model_path: str, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors under `prefix`, unprefixed; reads nothing else (the thinker
    next to them is many GB)."""
    from safetensors import safe_open

    state = {}
    for path in safetensors_files(model_path):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            state.update((k[len(prefix):], f.get_tensor(k)) for k in f.keys() if k.startswith(prefix))
    if not state:
        raise ValueError(f"{model_path}: the checkpoint has no {prefix}* tensors")
    return state


@dataclass(frozen=True)
class _Job:
    codes: torch.Tensor  # [L] on CPU
    speaker: str
    num_steps: int
    seed: int | None
