"""The 12 Hz speech tokenizer's decoder: RVQ codes [B, G, frames] -> waveform [B, 1, frames * 1920].

Our implementation of qwen-tts' `Qwen3TTSTokenizerV2Decoder` (parameter names match the
checkpoint's `speech_tokenizer/model.safetensors` below `decoder.`):

    codes -> split RVQ (group 0 alone, groups 1.. summed) -> causal conv -> 8-layer transformer
    (causal sliding-window attention, layer scale) -> 2 x (transposed conv + ConvNeXt) ->
    causal conv -> 4 x (SnakeBeta + transposed conv + 3 dilated residual units) -> SnakeBeta
    -> causal conv -> clamp to [-1, 1]

Everything is causal, so a frame's samples depend only on earlier frames: decoding in chunks
with enough left context reproduces the whole decode (see `decode_chunk`). Nearly all of the
work is the vocoder (the convolutions after the transformer, up to 24 kHz), and it reads only
`vocoder_context_frames` frames back (5 of the released model's 25 frames of context): a chunk
runs the transformer over its whole context and the vocoder over that much of it.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.model_executor.layers.activation import SnakeBeta
from vllm_omni.model_executor.layers.layernorm import rms_norm
from vllm_omni.model_executor.layers.rotary import RotaryEmbedding, apply_rotary_emb
from vllm_omni.model_executor.layers.vocoder import CausalConv, CausalTransConv, ResidualUnit, run_layers
from vllm_omni.model_executor.models.codec_streaming import CausalConvLayer, TransConvLayer, context_frames


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class UpsampleBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(in_dim), CausalTransConv(in_dim, out_dim, 2 * rate, rate),
                                    *(ResidualUnit(out_dim, d) for d in (1, 3, 9))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_layers(self.block, x)


class Codebook(nn.Module):
    """EMA codebook as stored: rows = embedding_sum / cluster_usage."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        table = self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]
        return F.embedding(codes, table)


class _Quantization(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self._codebook = Codebook(size, dim)


class _Layers(nn.Module):
    def __init__(self, num: int, size: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleList(_Quantization(size, dim) for _ in range(num))


class ResidualQuantizer(nn.Module):
    """Sum of the codebook rows of each group, projected by a 1x1 conv. `input_proj` is only
    used to encode; it is kept so the checkpoint loads strictly."""

    def __init__(self, num: int, size: int, dim: int, io_dim: int):
        super().__init__()
        self.vq = _Layers(num, size, dim)
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, groups, T] -> [B, io_dim, T]"""
        summed = sum(layer._codebook(codes[:, i]) for i, layer in enumerate(self.vq.layers))
        return self.output_proj(summed.transpose(1, 2))


class SplitQuantizer(nn.Module):
    def __init__(self, num_quantizers: int, size: int, codebook_dim: int):
        super().__init__()
        self.rvq_first = ResidualQuantizer(1, size, codebook_dim // 2, codebook_dim)
        self.rvq_rest = ResidualQuantizer(num_quantizers - 1, size, codebook_dim // 2, codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rotary_emb(self.q_proj(x).view(b * t, self.heads, self.head_dim), cos, sin)
        k = apply_rotary_emb(self.k_proj(x).view(b * t, self.kv_heads, self.head_dim), cos, sin)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _Scale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))


class _TransformerLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        hidden, eps = c["hidden_size"], c["rms_norm_eps"]
        head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
        self.self_attn = _Attention(hidden, c["num_attention_heads"], c["num_key_value_heads"], head_dim,
                                    c["attention_bias"])
        self.mlp = _MLP(hidden, c["intermediate_size"])
        self.input_layernorm = _Norm(hidden, eps)
        self.post_attention_layernorm = _Norm(hidden, eps)
        self.self_attn_layer_scale = _Scale(hidden)
        self.mlp_layer_scale = _Scale(hidden)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn_layer_scale.scale * self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp_layer_scale.scale * self.mlp(self.post_attention_layernorm(x))


class PreTransformer(nn.Module):
    """Causal sliding-window transformer over frames (positions restart at 0 per call)."""

    def __init__(self, c: dict):
        super().__init__()
        hidden = c["hidden_size"]
        self.window = c["sliding_window"]
        self.layers = nn.ModuleList(_TransformerLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = _Norm(hidden, c["rms_norm_eps"])
        self.input_proj = nn.Linear(c["latent_dim"], hidden)
        self.output_proj = nn.Linear(hidden, c["latent_dim"])
        head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
        self.rotary = RotaryEmbedding(head_dim, c["rope_theta"], c["max_position_embeddings"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, latent] -> [B, T, latent]"""
        b, t, _ = x.shape
        positions = torch.arange(t, device=x.device)
        cos, sin = self.rotary.cos_sin(positions.repeat(b), x.dtype)
        # transformers' sliding window: key j is visible from query i when i - window < j <= i.
        offset = positions[:, None] - positions[None, :]
        mask = (offset >= 0) & (offset < self.window)
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.output_proj(self.norm(h))


class SpeechDecoder(nn.Module):
    """Parameter layout of the checkpoint's `decoder.` tensors; `config` = its decoder_config."""

    def __init__(self, config: dict):
        super().__init__()
        c = config
        self.num_quantizers = c["num_quantizers"]
        self.codebook_size = c["codebook_size"]
        latent, dim = c["latent_dim"], c["decoder_dim"]
        self.samples_per_frame = math.prod(c["upsample_rates"]) * math.prod(c["upsampling_ratios"])
        self.quantizer = SplitQuantizer(c["num_quantizers"], c["codebook_size"], c["codebook_dim"])
        self.pre_conv = CausalConv(c["codebook_dim"], latent, 3)
        self.pre_transformer = PreTransformer(c)
        self.upsample = nn.ModuleList(nn.ModuleList([CausalTransConv(latent, latent, r, r), ConvNeXtBlock(latent)])
                                      for r in c["upsampling_ratios"])
        rates = c["upsample_rates"]
        self.decoder = nn.ModuleList([CausalConv(latent, dim, 7),
                                      *(UpsampleBlock(dim >> i, dim >> (i + 1), r) for i, r in enumerate(rates)),
                                      SnakeBeta(dim >> len(rates)), CausalConv(dim >> len(rates), 1, 7)])

    def forward(self, codes: torch.Tensor, skip_frames: int = 0) -> torch.Tensor:
        """codes [B, G, T] long -> waveform of frames [skip_frames, T) in [-1, 1]:
        [B, 1, (T - skip_frames) * samples_per_frame]. The vocoder starts at frame skip_frames, so
        only the samples of frames from skip_frames + vocoder_context_frames on are those of the
        whole window."""
        if codes.shape[1] != self.num_quantizers:
            raise ValueError(f"expected {self.num_quantizers} code groups, got {codes.shape[1]}")
        h = self.pre_conv(self.quantizer(codes))
        h = self.pre_transformer(h.transpose(1, 2)).transpose(1, 2)
        for trans_conv, convnext in self.upsample:
            h = convnext(trans_conv(h))
        h = h[..., skip_frames * self.vocoder_input_per_frame:]
        return run_layers(self.decoder, h).clamp(-1, 1)

    @property
    def vocoder_input_per_frame(self) -> int:
        return math.prod(trans_conv.conv.stride[0] for trans_conv, _ in self.upsample)

    @functools.cached_property
    def vocoder_context_frames(self) -> int:
        """How many frames before a frame the vocoder reads for that frame's samples (its
        receptive field, walked from its output back to its input, rounded up to frames)."""
        layers = [CausalConvLayer(layer.stride, layer.left) if isinstance(layer, CausalConv)
                  else TransConvLayer(layer.conv.kernel_size[0], layer.conv.stride[0], layer.trim_left)
                  for layer in _vocoder_layers(self.decoder) if isinstance(layer, (CausalConv, CausalTransConv))]
        return context_frames(layers, self.vocoder_input_per_frame)

    def decode_chunk(self, codes: torch.Tensor, start: int, end: int, left_context: int) -> torch.Tensor:
        """Samples of frames [start, end) of `codes` [B, G, T], decoded with up to
        `left_context` earlier frames (the transformer reads them all, the vocoder what it needs):
        [B, (end - start) * samples_per_frame]."""
        context = min(left_context, start)
        skip = max(0, context - self.vocoder_context_frames)
        wav = self(codes[..., start - context : end], skip)
        return wav[:, 0, (context - skip) * self.samples_per_frame :]

    def chunked_decode(self, codes: torch.Tensor, chunk: int = 300, left_context: int = 25) -> torch.Tensor:
        """qwen-tts' decode: chunks of `chunk` frames with `left_context` frames of context."""
        pieces = [self.decode_chunk(codes, s, min(s + chunk, codes.shape[-1]), left_context)
                  for s in range(0, codes.shape[-1], chunk)]
        return torch.cat(pieces, dim=-1)


def _vocoder_layers(modules) -> Iterator[nn.Module]:
    """The vocoder's layers in the order they run (a residual unit's branch; its skip path adds no
    reach)."""
    for module in modules:
        if isinstance(module, UpsampleBlock):
            yield from _vocoder_layers(module.block)
        elif isinstance(module, ResidualUnit):
            yield from (module.act1, module.conv1, module.act2, module.conv2)
        else:
            yield module
