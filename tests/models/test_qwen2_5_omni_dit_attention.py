"""The token2wav DiT's block-window attention against transformers' full masked attention.

transformers' `DiTDecoderLayer` masks a [T, T] attention by block distance; ours computes each
query block against its window only (token2wav_dit.py). One layer of a small random DiT, for
every look-back / look-ahead reach and lengths that end inside a block; on a GPU also through
the CUDA kernel (code2wav_ops.dit_window_attention), against transformers on the CPU.
"""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniDiTConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavDiTModel

from vllm_omni.model_executor.models.qwen2_5_omni.token2wav_dit import _decoder_layer, _modulated_norm

BLOCK = 8
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def dit():
    torch.manual_seed(0)
    config = Qwen2_5OmniDiTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, head_dim=16,
                                  ff_mult=2, emb_dim=16, mel_dim=8, num_embeds=32, block_size=BLOCK,
                                  look_ahead_layers=[], look_backward_layers=[])
    return Qwen2_5OmniToken2WavDiTModel(config).eval()


def on(device: str, *tensors):
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else on(device, *t) for t in tensors)


def ours(dit, device, hidden, time_embedding, rope, lengths):
    layer = dit.transformer_blocks[0].to(device)
    try:
        hidden, time_embedding, rope, lengths = on(device, hidden, time_embedding, rope, torch.tensor(lengths))
        modulation = layer.attn_norm.linear(layer.attn_norm.silu(time_embedding)).chunk(6, dim=1)
        shift, scale = modulation[:2]
        normed = _modulated_norm(layer.attn_norm.norm, hidden, scale, shift)
        out, _ = _decoder_layer(layer, hidden, normed, modulation, (layer.ff_norm, scale, shift), rope, lengths, {},
                                BLOCK)
        return out.cpu()
    finally:
        layer.cpu()


def layer_inputs(dit, rows: int, frames: int):
    gen = torch.Generator().manual_seed(frames)
    hidden = torch.randn(rows, frames, 64, generator=gen)
    time_embedding = torch.randn(rows, 64, generator=gen)
    positions = torch.arange(frames)[None].repeat(rows, 1)
    return hidden, time_embedding, dit.rotary_embed(hidden, positions)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("back,ahead", [(0, 0), (1, 0), (0, 1), (1, 1), (2, 1)])
@pytest.mark.parametrize("frames", [BLOCK, 5 * BLOCK, 5 * BLOCK - 3])
@torch.inference_mode()
def test_window_attention_is_transformers_block_attention(dit, back, ahead, frames, device):
    layer = dit.transformer_blocks[0]
    layer.look_backward_block, layer.look_ahead_block = back, ahead
    hidden, time_embedding, rope = layer_inputs(dit, 2, frames)
    block_diff = dit._create_block_diff(hidden)
    ref = layer(hidden, time_embedding, position_embeddings=rope, block_diff=block_diff)
    torch.testing.assert_close(ours(dit, device, hidden, time_embedding, rope, [frames, frames]), ref,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("back,ahead", [(1, 0), (0, 1)])
@torch.inference_mode()
def test_padded_row_is_the_row_alone(dit, back, ahead, device):
    """A short row padded to its batch's length gets, on its real frames, what it gets alone:
    no real query sees padding, whichever block the padding starts in."""
    layer = dit.transformer_blocks[0]
    layer.look_backward_block, layer.look_ahead_block = back, ahead
    short, long = 2 * BLOCK + 3, 5 * BLOCK + 1
    hidden, time_embedding, rope = layer_inputs(dit, 2, long)
    hidden[0, short:] = 1e3  # padding that would show if it leaked
    batched = ours(dit, device, hidden, time_embedding, rope, [short, long])
    alone = ours(dit, device, hidden[:1, :short], time_embedding[:1], tuple(t[:1, :short] for t in rope), [short])
    torch.testing.assert_close(batched[0, :short], alone[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(batched).all()
