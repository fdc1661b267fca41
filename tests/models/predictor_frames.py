"""The check both talkers' code predictors share: the function their CUDA graphs capture
(models/predictor_graphs.py), run eagerly, against the eager predictor."""
from __future__ import annotations

import torch

from vllm_omni.model_executor.models.predictor_graphs import PredictorFrame


def check_frame_matches_eager_predictor(talker, first_codes: list[int]) -> None:
    """Greedy codes equal the eager predictor's, a padded row changes nothing, and seeded
    sampling (at the talker's predictor settings) is reproducible and stays in the vocabulary."""
    graphed = talker.graphed_predictor
    predictor, width, vocab = graphed.predictor, graphed.width, graphed.vocab
    rows = len(first_codes)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, width, generator=g)
    first = talker.model.embed_tokens(torch.tensor(first_codes))
    with torch.inference_mode():
        eager_codes, eager_embeds = predictor(hidden, first, lambda logits, group: logits.argmax(dim=-1))
        frame = PredictorFrame(predictor, rows + 1, width, vocab, graphed.sampling, torch.device("cpu"),
                               torch.float32)
        frame.load(hidden, first, [True] * rows, [None] * rows)
        codes, embeds = frame(rows + 1)  # one padded row
        assert codes[:rows].tolist() == eager_codes.tolist()
        torch.testing.assert_close(embeds[:rows], eager_embeds)

        def sampled(seed: int) -> list:
            greedy = [i == 1 for i in range(rows)]
            frame.load(hidden, first, greedy, [None if gr else torch.Generator().manual_seed(seed) for gr in greedy])
            return frame(rows)[0].tolist()

        a, b, c = sampled(1), sampled(1), sampled(2)
    assert a == b and a != c and a[1] == eager_codes[1].tolist()  # the greedy row stays greedy
    assert all(0 <= code < vocab for row in a for code in row)
