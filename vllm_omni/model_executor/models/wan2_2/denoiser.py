"""diffusers' WanTransformer3DModel.forward, split at the transformer blocks.

`embed` and `finish` run the module calls of the diffusers forward around its blocks, so with
diffusers' own blocks (the CPU path) a whole forward is diffusers'. With `per_frame` (the
compiled CUDA path) a TI2V-5B batch's per-token timesteps, which are constant over each latent
frame, are embedded once per frame instead of once per token: the same values, a frame's
worth of tokens fewer rows in the timestep MLPs and the modulation. With sequence parallelism
each rank runs the blocks on its slice of the video tokens (with its rows of the RoPE tables
and of a per-frame modulation) and the blocks' output is gathered back on every rank.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import functools

import torch

from vllm_omni.model_executor.layers.sequence_parallel import SequenceParallelAttention, SequenceParallelGroup
from vllm_omni.model_executor.models.wan2_2.block import real_rope, sequence_parallel_self_attention
from vllm_omni.model_executor.models.wan2_2.inputs import Embedded, WanBatch


def embed(transformer: Any, batch: WanBatch, per_frame: bool) -> Embedded:
    x = batch.hidden_states
    p_t, p_h, p_w = transformer.config.patch_size
    grid = (x.shape[2] // p_t, x.shape[3] // p_h, x.shape[4] // p_w)
    rotary = transformer.rope(x)
    hidden = transformer.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()
    timestep, steps_per_row = batch.timestep, None
    if timestep.ndim == 2:  # expand_timesteps: one timestep per token
        if per_frame:
            timestep = timestep.view(timestep.shape[0], grid[0], -1)[:, :, 0]
        steps_per_row = timestep.shape[1]
        timestep = timestep.flatten()
    temb, proj, encoder, _ = transformer.condition_embedder(timestep, batch.encoder_hidden_states, None,
                                                            timestep_seq_len=steps_per_row)
    proj = proj.unflatten(2 if steps_per_row is not None else 1, (6, -1))
    return Embedded(hidden, encoder, temb, proj, rotary, grid, batch.expert, batch.steps)


def run_blocks(blocks: Sequence[Any], emb: Embedded, compiled: bool) -> torch.Tensor:
    """The blocks: diffusers' own, or their CompilableWanBlock wrappers (`compiled`), which take
    real RoPE tables and the modulation as [rows, T, 6, dim]."""
    return run_block_range(blocks, emb, None, compiled)


def run_block_range(blocks: Sequence[Any], emb: Embedded, rows: torch.Tensor | None, compiled: bool,
                    hidden: torch.Tensor | None = None, start: int = 0, end: int | None = None,
                    sequence: SequenceParallelGroup | None = None) -> torch.Tensor:
    """Blocks [start, end) over `rows` of the batch (None: all), from `hidden` (those rows' image
    stream; None: the block input). `sequence` needs our blocks (`compiled`)."""
    encoder, proj, rope = emb.encoder, emb.timestep_proj, emb.rotary
    if rows is not None:
        encoder, proj = encoder[rows], proj[rows]
    if hidden is None:
        hidden = emb.hidden if rows is None else emb.hidden[rows]
    if not compiled:
        for block in blocks[start:end]:
            hidden = block(hidden, encoder, proj, rope)
        return hidden
    rope = real_rope(rope)
    proj = proj if proj.ndim == 4 else proj.unsqueeze(1)
    if sequence is None:
        for block in blocks[start:end]:
            hidden = block(hidden, encoder, proj, rope)
        return hidden
    plan = sequence.plan(hidden.shape[1])
    attend = functools.partial(sequence_parallel_self_attention, attention=SequenceParallelAttention(sequence),
                               plan=plan)
    proj, rope = _local_modulation(proj, plan.offset, plan.lengths[sequence.rank], hidden.shape[1]), \
        tuple(plan.local(t, 1) for t in rope)
    hidden = plan.local(hidden, 1)
    for block in blocks[start:end]:
        hidden = block(hidden, encoder, proj, rope, attend)
    return plan.gather(hidden, 1)


def _local_modulation(proj: torch.Tensor, offset: int, length: int, tokens: int) -> torch.Tensor:
    """A rank's part of the modulation [rows, T, 6, dim] for its tokens [offset, offset + length):
    one per token where T > 1 (a rank's slice need not start or end on a frame)."""
    if proj.shape[1] == 1:
        return proj
    per_group = tokens // proj.shape[1]
    index = torch.arange(offset, offset + length, device=proj.device) // per_group
    return proj.index_select(1, index)


def finish(transformer: Any, emb: Embedded, hidden: torch.Tensor) -> torch.Tensor:
    """The output norm, projection and unpatchify of diffusers' forward; [rows, C, F, H, W]."""
    rows, tokens, dim = hidden.shape
    temb = emb.temb if emb.temb.ndim == 3 else emb.temb.unsqueeze(1)  # [rows, T, dim]: T = 1, frames or tokens
    shift, scale = (transformer.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
    grouped = hidden.view(rows, temb.shape[1], -1, dim)
    out = (transformer.norm_out(grouped.float()) * (1 + scale) + shift).type_as(hidden).view(rows, tokens, dim)
    out = transformer.proj_out(out)
    p_t, p_h, p_w = transformer.config.patch_size
    out = out.reshape(rows, *emb.grid, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return out.flatten(6, 7).flatten(4, 5).flatten(2, 3)
