"""layers/vocoder.py: a SnakeBeta that writes the next causal conv's padding, run_layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_omni.model_executor.layers.activation import SnakeBeta
from vllm_omni.model_executor.layers.vocoder import (
    CausalConv, CausalTransConv, ResidualUnit, run_layers, transposed_conv_as_gemm,
)


def _randomized(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return module.eval()


def test_activation_writes_the_conv_padding():
    snake, conv = _randomized(SnakeBeta(6)), _randomized(CausalConv(6, 5, 7, dilation=3))
    x = torch.randn(2, 6, 40)
    assert torch.equal(snake(x, left_pad=4)[..., :4], torch.zeros(2, 6, 4))
    assert torch.equal(conv(x, snake), conv(snake(x)))
    strided = _randomized(CausalConv(6, 5, 4, stride=2))  # pads on its own (right too)
    assert torch.equal(strided(x, snake), strided(snake(x)))


def test_run_layers_is_the_layers_in_order():
    layers = _randomized(torch.nn.ModuleList([
        CausalConv(4, 6, 7), SnakeBeta(6), CausalTransConv(6, 3, 4, 2, trim_left=2), ResidualUnit(3, 3),
        SnakeBeta(3), CausalConv(3, 1, 7), SnakeBeta(1)]))
    x = torch.randn(2, 4, 30)
    want = x
    for layer in layers:
        want = layer(want)
    assert torch.equal(run_layers(layers, x), want)
    assert want.shape == (2, 1, (30 - 1) * 2 + 4 - 2 - 2)  # the transposed conv trims 2 + 2


def test_conv_without_its_bias():
    conv = _randomized(CausalConv(6, 5, 7, dilation=2))
    x = torch.randn(2, 6, 40)
    torch.testing.assert_close(conv(x, bias=False) + conv.conv.bias[:, None], conv(x))
    snake = _randomized(SnakeBeta(5))
    y = conv(x, bias=False)
    assert torch.equal(snake(y, bias=conv.conv.bias), snake(y + conv.conv.bias[:, None]))


def test_transposed_conv_as_gemm_is_conv_transpose1d():
    g = torch.Generator().manual_seed(0)
    for c_in, c_out, kernel, stride in [(6, 4, 16, 8), (5, 3, 6, 3), (4, 4, 2, 2), (3, 2, 4, 4), (2, 3, 15, 5)]:
        x = torch.randn(2, c_in, 11, generator=g, dtype=torch.float64)
        weight = torch.randn(c_in, c_out, kernel, generator=g, dtype=torch.float64)
        bias = torch.randn(c_out, generator=g, dtype=torch.float64)
        for b in (bias, None):
            torch.testing.assert_close(transposed_conv_as_gemm(x, weight, b, stride),
                                       F.conv_transpose1d(x, weight, b, stride), atol=1e-12, rtol=0)
