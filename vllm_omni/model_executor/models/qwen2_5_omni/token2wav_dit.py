"""Qwen2.5-Omni token2wav DiT: transformers' flow-matching `sample`, for a batch of rows of
different lengths, each from its own noise.

transformers' `Qwen2_5OmniToken2WavDiTModel.forward` has no padding mask (its block
attention spans a whole batch row), and `sample` draws its noise inside. This module runs
the same submodules (the checkpoint's weights) with:

- right padding and a mask that keeps real positions and padding apart, so a row's mel
  depends only on its own codes, speaker and noise, whatever shares its batch;
- the speaker encoder run once per voice instead of in every solver evaluation (it sees
  only the reference mel, the same each time);
- noise drawn block by block from the request's own generator (`draw_noise`), the order
  in which transformers' single `torch.randn` call draws it on the CPU, so a stream that
  learns its length only at its end gets the same noise as the whole request.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

# transformers' Qwen2_5OmniToken2WavModel.forward defaults.
GUIDANCE_SCALE = 0.5
SWAY_COEFFICIENT = -1.0
# A block difference no layer's look-back / look-ahead reaches: masks a query-key pair.
_APART = torch.iinfo(torch.int16).max


@dataclass(frozen=True)
class DiTRow:
    """One row of a DiT batch: a request, or a window of a stream."""

    codes: torch.Tensor  # [L] codec codes (CPU, long)
    noise: torch.Tensor  # [L * repeats, mel_dim] the ODE's start (CPU, float32)
    speaker_embedding: torch.Tensor  # [enc_emb_dim] the voice's `cond`
    speaker_features: torch.Tensor  # [2, enc_dim] speaker encoder of its ref_mel, then of zeros


def speaker_features(dit, ref_mel: torch.Tensor) -> torch.Tensor:
    """[2, enc_dim]: what transformers' input embedding computes in every evaluation, once:
    the speaker encoder of the reference mel (guided half) and of zeros (unguided half)."""
    return dit.input_embed.spk_encoder(torch.cat([ref_mel, torch.zeros_like(ref_mel)]))


def new_generator(seed: int | None) -> torch.Generator:
    """A request's noise generator, on the CPU whatever the device (so that a seed means the
    same audio on every device and streamed noise can be drawn in pieces)."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()  # unseeded request: fresh entropy, like vLLM's unseeded sampling
    else:
        gen.manual_seed(seed)
    return gen


def draw_noise(gen: torch.Generator, frames: int, mel_dim: int) -> torch.Tensor:
    """The next `frames` rows of a request's noise [frames, mel_dim]. On the CPU, draws of
    whole rows continue one another exactly when mel_dim is a multiple of 16 (80 in the
    released model), which is why the pieces join up to transformers' one draw."""
    return torch.randn(frames, mel_dim, generator=gen, dtype=torch.float32)


def sample_mel(dit, rows: list[DiTRow], num_steps: int, device: torch.device, bf16: bool = False,
               forward: Callable[..., torch.Tensor] | None = None) -> list[torch.Tensor]:
    """transformers' `sample` (RK4 flow matching, classifier-free guidance 0.5, sway -1) for
    rows of any lengths in one batch; returns each row's mel [frames, mel_dim] (float32, CPU).
    `bf16`: the DiT evaluations under bfloat16 autocast; the ODE state stays float32.
    `forward`: `forward_cfg` or a compiled version of it."""
    forward = forward or forward_cfg
    lengths = [r.noise.shape[0] for r in rows]
    longest, batch, repeats = max(lengths), len(rows), dit.repeats
    noise = torch.zeros(batch, longest, dit.mel_dim)
    codes = torch.zeros(batch, longest // repeats, dtype=torch.long)
    for i, row in enumerate(rows):
        noise[i, : lengths[i]] = row.noise
        codes[i, : row.codes.numel()] = row.codes
    codes = codes.to(device)
    speaker = torch.stack([r.speaker_embedding for r in rows]).to(device, torch.float32)
    feats = torch.stack([r.speaker_features for r in rows]).to(device, torch.float32)  # [B, 2, enc_dim]
    feats = torch.cat([feats[:, 0], feats[:, 1]])  # guided rows, then unguided rows (transformers' order)
    block_diff = _masked_block_diff(torch.tensor(lengths, device=device), longest, dit.block_size)

    def velocity(time: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        out = forward(dit, x, time, codes, speaker, feats, block_diff)
        guided, unguided = torch.chunk(out.float(), 2, dim=0)
        return guided + (guided - unguided) * GUIDANCE_SCALE

    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

    times = torch.linspace(0, 1, num_steps, device=device, dtype=torch.float32)
    times += SWAY_COEFFICIENT * (torch.cos(torch.pi / 2 * times) - 1 + times)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with autocast:
        mel = RungeKutta4ODESolver(function=velocity, initial_value=noise.to(device)).integrate(times)[-1]
    mel = mel.float().cpu()
    return [mel[i, :n] for i, n in enumerate(lengths)]


def forward_cfg(dit, x, time, codes, speaker, feats, block_diff) -> torch.Tensor:
    """transformers' DiT forward with apply_cfg=True ([guided rows; unguided rows]), given the
    speaker features and a padding-aware block difference."""
    rows, frames = x.shape[0], x.shape[1]
    time_embedding = dit.time_embed(time.repeat(2 * rows))
    code_embed = torch.cat([dit.text_embed(codes), dit.text_embed(codes, drop_code=True)])
    speaker = torch.cat([speaker, torch.zeros_like(speaker)]).unsqueeze(1).expand(-1, frames, -1)
    feats = feats.unsqueeze(1).expand(-1, frames, -1)
    hidden = dit.input_embed.proj(torch.cat([x.repeat(2, 1, 1), feats, code_embed, speaker], dim=-1))
    positions = torch.arange(frames, device=x.device)[None, :].repeat(2 * rows, 1)
    rope = dit.rotary_embed(hidden, positions)
    for layer in dit.transformer_blocks:
        hidden = layer(hidden, time_embedding, position_embeddings=rope, block_diff=block_diff)
    return dit.proj_out(dit.norm_out(hidden, time_embedding))


def _masked_block_diff(lengths: torch.Tensor, frames: int, block_size: int) -> torch.Tensor:
    """[2B, 1, T, T] key block - query block (what each layer's look-back / look-ahead mask
    reads), with real and padding positions never seeing each other. Padding sees padding,
    so that no softmax row is empty (that would be NaN, and NaN * 0 reaches real rows)."""
    index = torch.arange(frames, device=lengths.device)
    blocks = index // block_size
    diff = (blocks[None, :] - blocks[:, None]).to(torch.int16)  # [T, T]
    real = index[None, :] < lengths[:, None]  # [B, T]
    both_real = real[:, :, None] & real[:, None, :]
    both_padding = ~real[:, :, None] & ~real[:, None, :]
    out = torch.where(both_real, diff, torch.where(both_padding, 0, _APART).to(torch.int16))
    return out.repeat(2, 1, 1)[:, None]
