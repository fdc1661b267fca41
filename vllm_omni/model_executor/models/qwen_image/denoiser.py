"""diffusers' QwenImageTransformer2DModel.forward, split at the transformer blocks.

The parts run exactly the module calls of the diffusers forward (no zero_cond_t, no
ControlNet), so a whole forward equals diffusers' to the bit; the split lets the engine's
TeaCache skip the blocks for some rows of a batch and reuse their cached residuals.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from vllm_omni.model_executor.layers.sequence_parallel import SequenceParallelAttention, SequenceParallelGroup
from vllm_omni.model_executor.models.qwen_image.block import (joint_attention, length_runs, real_rope,
                                                              sequence_parallel_joint_attention)
from vllm_omni.model_executor.models.qwen_image.inputs import Embedded, QwenImageBatch


def embed(transformer: Any, batch: QwenImageBatch) -> Embedded:
    from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask

    hidden = transformer.img_in(batch.hidden_states)
    timestep = batch.timestep.to(hidden.dtype)
    encoder = transformer.txt_in(transformer.txt_norm(batch.encoder_hidden_states))
    text_seq_len, _, mask = compute_text_seq_len_from_mask(encoder, batch.encoder_mask)
    temb = transformer.time_text_embed(timestep, hidden, None)
    rope = transformer.pos_embed(batch.img_shapes, max_txt_seq_len=text_seq_len, device=hidden.device)
    return Embedded(hidden, encoder, mask, batch.text_lengths, temb, rope, batch.num_latent_tokens, batch.steps)


def modulated_input(transformer: Any, emb: Embedded) -> torch.Tensor:
    """The first block's modulated image input: what TeaCache compares between steps."""
    block = transformer.transformer_blocks[0]
    img_mod1 = block.img_mod(emb.temb).chunk(2, dim=-1)[0]
    modulated, _ = block._modulate(block.img_norm1(emb.hidden), img_mod1)
    return modulated


def run_blocks(blocks: Sequence[Any], emb: Embedded, rows: torch.Tensor | None, compiled: bool,
               sequence: SequenceParallelGroup | None = None) -> torch.Tensor:
    """The transformer blocks' image output over `rows` of the batch (None: all)."""
    return run_block_range(blocks, emb, rows, compiled, sequence=sequence)[0]


def run_block_range(blocks: Sequence[Any], emb: Embedded, rows: torch.Tensor | None, compiled: bool,
                    state: tuple[torch.Tensor, torch.Tensor] | None = None, start: int = 0, end: int | None = None,
                    sequence: SequenceParallelGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [start, end) over `rows` of the batch (None: all), from `state` (the image and text
    streams of those rows; None: the block inputs): diffusers' blocks with the padding mask, or
    our CompilableBlock wrappers (`compiled`, and always with sequence parallelism), which need
    no mask. Returns (image, text), whole on every rank."""
    hidden, encoder, mask, temb, lengths = emb.hidden, emb.encoder, emb.mask, emb.temb, emb.text_lengths
    if rows is not None:
        hidden, encoder, temb = hidden[rows], encoder[rows], temb[rows]
        mask = mask[rows] if mask is not None else None
        lengths = tuple(lengths[i] for i in rows.tolist())
    if state is not None:
        hidden, encoder = state
    blocks = blocks[start:end]
    if not compiled:
        for block in blocks:
            encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder,
                                    encoder_hidden_states_mask=mask, temb=temb, image_rotary_emb=emb.rope,
                                    joint_attention_kwargs={}, modulate_index=None)
        return hidden, encoder
    image_rope, text_rope = real_rope(emb.rope[0]), real_rope(emb.rope[1])
    runs = length_runs(lengths)
    if sequence is None:
        attend = functools.partial(joint_attention, text_tokens=encoder.shape[1], runs=runs)
    else:
        # Each rank runs the blocks on its slice of the image tokens (and its rows of their RoPE
        # table) with the whole prompt; the blocks' image output is gathered back on every rank.
        plan = sequence.plan(hidden.shape[1])
        hidden, image_rope = plan.local(hidden, 1), tuple(plan.local(t, 0) for t in image_rope)
        attend = functools.partial(sequence_parallel_joint_attention, attention=SequenceParallelAttention(sequence),
                                   plan=plan, runs=runs)
    for block in blocks:
        encoder, hidden = block(hidden, encoder, temb, (*image_rope, *text_rope), attend)
    return (hidden if sequence is None else plan.gather(hidden, 1)), encoder


def finish(transformer: Any, emb: Embedded, hidden: torch.Tensor) -> torch.Tensor:
    """Velocity for the sample's tokens (an edit's image tokens are dropped, as the pipeline does)."""
    out = transformer.proj_out(transformer.norm_out(hidden, emb.temb))
    return out[:, :emb.num_latent_tokens]


def check_supported(transformer: Any) -> None:
    config = transformer.config
    for flag in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope", "guidance_embeds"):
        if config.get(flag, False):
            raise ValueError(f"QwenImageTransformer2DModel with {flag}=True (a later Qwen-Image variant) is not "
                             "supported by the native engine; use --diffusion-load-format diffusers")
