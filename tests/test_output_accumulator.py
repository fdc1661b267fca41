"""The one place output deltas accumulate: what each RequestOutputKind hands its reader."""
from __future__ import annotations

import torch

from vllm_omni.output_accumulator import OutputAccumulator
from vllm_omni.outputs import RequestOutputKind
from vllm_omni.stage_io import StageOutput

RATE = torch.tensor(24000, dtype=torch.int32)


def deltas() -> list[StageOutput]:
    """A request's three deltas: tokens, text, logprobs, audio rows (the rate once, as models send it)."""
    return [
        StageOutput(request_id="r", finished=False, new_token_ids=[1, 2], new_text="ab",
                    new_logprobs=[{1: -0.1}, {2: -0.2}], cumulative_logprob=-0.3,
                    multimodal_output={"audio": torch.arange(3.0), "sample_rate": RATE}, num_cached_tokens=16),
        StageOutput(request_id="r", finished=False, new_token_ids=[3], new_text="c", new_logprobs=[{3: -0.3}],
                    cumulative_logprob=-0.6, multimodal_output={"audio": torch.arange(3.0, 5.0)}, num_cached_tokens=16),
        StageOutput(request_id="r", finished=True, new_token_ids=[4], new_text="d", new_logprobs=[{4: -0.4}],
                    cumulative_logprob=-1.0, finish_reason="length", num_cached_tokens=16),
    ]


def check_whole(comp) -> None:
    assert comp.token_ids == [1, 2, 3, 4] and comp.text == "abcd" and comp.finish_reason == "length"
    assert comp.logprobs == [{1: -0.1}, {2: -0.2}, {3: -0.3}, {4: -0.4}] and comp.cumulative_logprob == -1.0
    assert torch.equal(comp.multimodal_output["audio"], torch.arange(5.0))
    assert torch.equal(comp.multimodal_output["sample_rate"], RATE)  # metadata: replaced, not stacked


def test_final_only_hands_out_the_whole_output_once():
    acc = OutputAccumulator("user-id", "prompt", [7, 8])
    made = [acc.add(d) for d in deltas()]
    assert made[:2] == [None, None]
    out, new = made[2]
    assert new is out.outputs[0] and out.finished and out.request_id == "user-id"
    assert out.prompt == "prompt" and out.prompt_token_ids == [7, 8] and out.num_cached_tokens == 16
    check_whole(out.outputs[0])


def test_cumulative_snapshots_stay_as_they_were_handed_out():
    acc = OutputAccumulator("r", None, [7], RequestOutputKind.CUMULATIVE)
    made = [acc.add(d) for d in deltas()]
    first, first_new = made[0]
    assert first.outputs[0].token_ids == [1, 2] and first.outputs[0].text == "ab"
    assert first.outputs[0].logprobs == [{1: -0.1}, {2: -0.2}]
    assert torch.equal(first.outputs[0].multimodal_output["audio"], torch.arange(3.0)) and not first.finished
    assert first_new.token_ids == [1, 2] and torch.equal(first_new.multimodal_output["audio"], torch.arange(3.0))
    second, second_new = made[1]
    assert second.outputs[0].token_ids == [1, 2, 3] and second_new.token_ids == [3] and second_new.text == "c"
    assert torch.equal(second.outputs[0].multimodal_output["audio"], torch.arange(4.0 + 1))
    assert "sample_rate" not in second_new.multimodal_output  # metadata comes in the first delta only
    check_whole(made[2][0].outputs[0])


def test_delta_outputs_hold_only_what_is_new():
    acc = OutputAccumulator("r", None, [7], RequestOutputKind.DELTA)
    made = [acc.add(d) for d in deltas()]
    for (out, new), d in zip(made, deltas()):
        assert out.outputs[0] is new and out.finished == d.finished and out.prompt_token_ids == [7]
        assert new.token_ids == d.new_token_ids and new.text == d.new_text and new.logprobs == d.new_logprobs
    assert torch.equal(made[1][1].multimodal_output["audio"], torch.arange(3.0, 5.0))
    check_whole(acc.output.outputs[0])  # still folded: bridges read the whole upstream output
