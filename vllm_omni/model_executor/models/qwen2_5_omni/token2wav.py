"""Qwen2.5-Omni code2wav stage: codec codes + speaker -> 24 kHz waveform (DiT + BigVGAN).

A thin wrapper around transformers' `Qwen2_5OmniToken2WavModel` (DESIGN section 5), loaded
from the `token2wav.*` tensors of the full checkpoint, driven as a generation-stage model
(`stage_io.GenerationModel`). What differs from transformers' `forward`:

- The DiT's flow-matching ODE starts from noise drawn from each request's own seeded
  generator (`sampling_params.seed`), not the global RNG, so a waveform depends only on its
  request, never on what else shares the batch. transformers' `sample` draws the noise inside,
  so its short solver loop is repeated here around the same DiT forward.
- Requests with the same code length, speaker and solver settings run as one batch; the DiT
  and the vocoder have no padding mask, so different lengths cannot share a batch.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_omni.stage_io import StageRequest
from vllm_omni.model_executor.dtypes import canonical_dtype
from vllm_omni.model_executor.model_loader import safetensors_files
from vllm_omni.model_executor.models.qwen2_5_omni.bridges import Code2WavInputs

logger = logging.getLogger(__name__)

SPEAKER_FILE = "spk_dict.pt"
DEFAULT_SPEAKER = "Chelsie"  # transformers' generate default
SAMPLE_RATE = 24000
WEIGHT_PREFIX = "token2wav."
# transformers' Qwen2_5OmniToken2WavModel.forward defaults.
DEFAULT_NUM_STEPS = 10
DEFAULT_GUIDANCE_SCALE = 0.5
DEFAULT_SWAY_COEFFICIENT = -1.0


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
    """GenerationModel for the `code2wav` stage; `generate_batch` -> [{"audio": float32 [N],
    "sample_rate": int32 []}]."""

    def __init__(self, module: torch.nn.Module, speakers: dict[str, Speaker], device: torch.device,
                 num_steps: int = DEFAULT_NUM_STEPS) -> None:
        self.module = module
        self.speakers = speakers
        self.device = device
        self.num_steps = num_steps
        self.sample_rate = SAMPLE_RATE

    @classmethod
    def load(cls, model_path: str, *, model_stage: str | None = None, device: torch.device | str = "cpu",
             dtype: str = "auto", num_steps: int = DEFAULT_NUM_STEPS,
             load_format: str = "auto") -> Qwen2_5OmniToken2Wav:
        from transformers import AutoConfig
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

        if canonical_dtype(dtype) not in ("auto", "float32"):
            # transformers casts token2wav to float32 before use too: the ODE and the vocoder
            # lose too much in half precision.
            logger.info("code2wav runs in float32; ignoring dtype=%s", dtype)
        config = AutoConfig.from_pretrained(model_path)
        t2w_config = getattr(config, "token2wav_config", None)
        if t2w_config is None:
            raise ValueError(f"{model_path}: config has no token2wav_config (not a Qwen2.5-Omni checkpoint?)")
        device = torch.device(device)
        with torch.device(device):  # random init (overwritten below) is much faster on a GPU
            module = Qwen2_5OmniToken2WavModel(t2w_config).float()
        if load_format != "dummy":  # dummy: keep the random init (benchmarks)
            # from_pretrained would not strip the `token2wav.` prefix of the full checkpoint.
            module.load_state_dict(_prefixed_tensors(model_path, WEIGHT_PREFIX), strict=True)
        return cls(module.eval(), load_speakers(model_path), device, num_steps)

    # ------------------------------------------------------------------ batch entry point
    @torch.inference_mode()
    def generate_batch(self, inputs: list[StageRequest]) -> list[dict[str, torch.Tensor]]:
        jobs = [self._job(req) for req in inputs]
        results: list[torch.Tensor | None] = [None] * len(jobs)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            if job.codes.numel() == 0:
                results[i] = torch.zeros(0, dtype=torch.float32)
            else:
                groups[job.group_key].append(i)
        for members in groups.values():
            for i, wav in zip(members, self._synthesize([jobs[i] for i in members])):
                results[i] = wav
        # The rate travels with the audio so that callers (CLI, server) can encode it without
        # knowing the model; a 0-dim tensor is metadata, replaced rather than concatenated.
        rate = torch.tensor(self.sample_rate, dtype=torch.int32)
        return [{"audio": wav, "sample_rate": rate} for wav in results]

    def _job(self, req: StageRequest) -> _Job:
        inputs = Code2WavInputs.from_info(req.additional_information)
        num_steps = self.num_steps if inputs.num_steps is None else inputs.num_steps
        speaker = select_speaker(self.speakers, inputs.speaker)
        dit = self.module.code2wav_dit_model
        codes = torch.tensor(req.prompt_token_ids, dtype=torch.long)
        if codes.numel() and not (0 <= int(codes.min()) and int(codes.max()) <= dit.config.num_embeds):
            raise ValueError(f"request {req.request_id}: codec codes must lie in [0, {dit.config.num_embeds}]")
        if codes.numel() * dit.repeats > dit.config.max_position_embeddings:
            raise ValueError(f"request {req.request_id}: {codes.numel()} codes exceed the DiT's "
                             f"{dit.config.max_position_embeddings // dit.repeats}-code limit")
        if num_steps < 2:
            raise ValueError(f"request {req.request_id}: num_steps must be >= 2, got {num_steps}")
        return _Job(codes, speaker, num_steps, req.sampling_params.seed)

    def _synthesize(self, jobs: list[_Job]) -> list[torch.Tensor]:
        """One batched DiT + vocoder pass over jobs sharing code length, speaker and steps."""
        dev, dit = self.device, self.module.code2wav_dit_model
        speaker = self.speakers[jobs[0].speaker]
        codes = torch.stack([j.codes for j in jobs]).to(dev)  # [B, L]
        batch = len(jobs)
        cond = speaker.cond.to(dev, torch.float32).expand(batch, -1)
        ref_mel = speaker.ref_mel.to(dev, torch.float32).expand(batch, -1, -1)
        frames = codes.shape[1] * dit.repeats
        noise = torch.cat([_noise(j.seed, (1, frames, dit.mel_dim), dev) for j in jobs])
        mel = _sample_mel(dit, cond, ref_mel, codes, noise, jobs[0].num_steps)
        wav = self.module.code2wav_bigvgan_model(mel)  # squeezed and on CPU: [B, N] or [N]
        return list(wav.reshape(batch, -1).float().unbind(0))


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

    @property
    def group_key(self) -> tuple:
        return (self.codes.numel(), self.speaker, self.num_steps)


def _noise(seed: int | None, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()  # unseeded request: fresh entropy, like vLLM's unseeded sampling
    else:
        gen.manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)


def _sample_mel(dit, cond: torch.Tensor, ref_mel: torch.Tensor, codes: torch.Tensor, noise: torch.Tensor,
                num_steps: int, guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
                sway_coefficient: float | None = DEFAULT_SWAY_COEFFICIENT) -> torch.Tensor:
    """transformers' `Qwen2_5OmniToken2WavDiTModel.sample`, starting from `noise` [B, T, mel]."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

    cond = cond.unsqueeze(1).repeat(1, noise.shape[1], 1)

    def velocity(time_step, hidden_states):
        if guidance_scale < 1e-5:
            return dit(hidden_states=hidden_states, speaker_embedding=cond, condition_vector=ref_mel,
                       quantized_code=codes, time_step=time_step, drop_audio_conditioning=False,
                       drop_code=False, apply_cfg=False)
        out = dit(hidden_states=hidden_states, quantized_code=codes, speaker_embedding=cond,
                  condition_vector=ref_mel, time_step=time_step, apply_cfg=True)
        guided, unconditioned = torch.chunk(out, 2, dim=0)
        return guided + (guided - unconditioned) * guidance_scale

    times = torch.linspace(0, 1, num_steps, device=codes.device, dtype=cond.dtype)
    if sway_coefficient is not None:
        times += sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)
    trajectory = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(times)
    return trajectory[-1].permute(0, 2, 1)  # [B, mel, T]
