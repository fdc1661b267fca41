"""The code predictors' in-graph sampling (`predictor_graphs.sample_codes`) draws from the same
distribution as our Sampler's top-k / top-p rule: empirical frequencies of many draws against
the probabilities the Sampler's own masking gives."""
from __future__ import annotations

import pytest
import torch

from vllm_omni.model_executor.layers.sampler import apply_top_k_top_p
from vllm_omni.model_executor.models.predictor_graphs import sample_codes

DRAWS = 40000


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.9, 5, 1.0), (1.0, 5, 0.8), (0.7, 0, 0.9), (1.0, 0, 1.0)])
def test_draws_follow_the_sampler_distribution(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=g) * 2
    vocab = logits.shape[1]
    reference = apply_top_k_top_p(logits / temperature, torch.tensor([top_k if top_k > 0 else vocab]),
                                  torch.tensor([top_p])).softmax(dim=-1)[0]
    gumbel = -torch.empty(DRAWS, vocab).exponential_(generator=g).log()
    codes = sample_codes(logits.expand(DRAWS, -1), torch.zeros(DRAWS, dtype=torch.bool), gumbel, temperature,
                         top_k, top_p)
    frequencies = torch.bincount(codes, minlength=vocab).float() / DRAWS
    assert frequencies[reference == 0].sum() == 0  # nothing outside the top-k / nucleus
    assert (frequencies - reference).abs().max() < 0.01  # 4 standard deviations at most


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    gumbel = torch.full((3, 20), 100.0)
    gumbel[:, 0] = 1000.0  # noise that would pick code 0 for a sampled row
    codes = sample_codes(logits, torch.tensor([True, False, True]), gumbel, 1.0, 0, 1.0)
    assert codes.tolist() == [logits[0].argmax().item(), 0, logits[2].argmax().item()]
