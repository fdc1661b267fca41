"""Streaming edges (async_chunk) through `Omni`, both omni families: the talker starts while the
thinker still generates, and every output is what the non-streaming path (window_size -1, itself
equal to transformers: test_*_pipeline.py) gives; flow control pauses a producer whose consumer
falls behind, and changes nothing in the outputs. The streamed runs of the bundled configs are
the package's pipelines of real stage processes (omni25, omni3); the other settings run their
stages as threads."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.conftest import in_threads
from tests.e2e.conftest import BATCH_8, by_request, mixed_prompts, short_params, user
from tests.e2e.test_qwen3_omni_pipeline import PARAMS as QWEN3_PARAMS
from tests.e2e.test_qwen3_omni_pipeline import mixed_prompts as qwen3_prompts
from vllm_omni import Omni

# family -> (its checkpoint's fixture, the package's streaming pipeline's fixture, prompts, params)
FAMILIES = {
    "qwen2_5_omni": ("omni_dir", "omni25", mixed_prompts, lambda: short_params(thinker=12, talker=24)),
    "qwen3_omni_moe": ("qwen3_omni_voices_dir", "omni3", qwen3_prompts, lambda: QWEN3_PARAMS),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, omni25, omni3):  # named here, not looked up: the xdist grouping sees them (tests/conftest.py)
    ckpt, omni, prompts, params = FAMILIES[request.param]
    return (request.param, request.getfixturevalue(ckpt), {"omni25": omni25, "omni3": omni3}[omni], prompts(),
            params())


def counters(omni, stage_id):
    return omni._runtime.orchestrator.stage_counters[stage_id]


def assert_same(got: dict, ref: dict, where: str) -> None:
    assert sorted(got) == sorted(ref) == ["audio", "text"], where
    text, ref_text = got["text"].request_output.outputs[0], ref["text"].request_output.outputs[0]
    assert text.token_ids == ref_text.token_ids and text.text == ref_text.text, where
    codes, ref_codes = got["audio"].request_output.prompt_token_ids, ref["audio"].request_output.prompt_token_ids
    wav = got["audio"].request_output.outputs[0].multimodal_output["audio"]
    ref_wav = ref["audio"].request_output.outputs[0].multimodal_output["audio"]
    assert codes == ref_codes, where
    torch.testing.assert_close(wav, ref_wav, atol=1e-4, rtol=0, msg=where)


def test_streaming_outputs_equal_the_non_streaming_path(family):
    name, ckpt, omni, prompts, params = family
    with Omni(model=str(ckpt), stage_overrides=in_threads(3, BATCH_8), async_chunk=False) as whole:
        assert whole._runtime.orchestrator._streaming == {}
        reference = by_request(whole.generate(prompts, params, use_tqdm=False))
    assert 1 in omni._runtime.orchestrator._streaming  # the bundled deploy config streams thinker -> talker
    early_starts = counters(omni, 1)["early_starts"]
    streamed = by_request(omni.generate(prompts, params, use_tqdm=False))
    # The talker started every request before the thinker had finished it.
    assert counters(omni, 1)["early_starts"] - early_starts == len(prompts)
    for i, (got, ref) in enumerate(zip(streamed, reference, strict=True)):
        assert_same(got, ref, f"{name} prompt {i}")


def test_flow_control_pauses_a_producer_and_changes_nothing(omni_dir):
    """The talker takes one request at a time while the thinker runs four: the thinker's rows
    pile up for the waiting ones until the backlog limit pauses them; outputs stay the same."""
    prompts = [{"messages": user({"type": "text", "text": f"Count to {n}, slowly."})} for n in range(4)]
    params = short_params(thinker=48, talker=8)
    overrides = {"0": {"max_num_seqs": 4}, "1": {"max_num_seqs": 1}, "2": {"max_num_seqs": 4}}
    with Omni(model=str(omni_dir), stage_overrides=in_threads(3, overrides), async_chunk=False) as omni:
        reference = by_request(omni.generate(prompts, params, use_tqdm=False))
    with Omni(model=str(omni_dir), stage_overrides=in_threads(3, overrides)) as omni:
        orch = omni._runtime.orchestrator
        limit = 3
        # thinker -> talker only: code2wav's edge keeps its floor (it needs a chunk of codes first).
        orch._streaming[1] = dataclasses.replace(orch._streaming[1], max_pending_units=limit)
        assert orch._streaming[2].max_pending_units >= 2 * orch.pools[2].info.stream_units_per_chunk
        streamed = by_request(omni.generate(prompts, params, use_tqdm=False))
        paused, resumed = counters(omni, 0)["pauses"], counters(omni, 0)["resumes"]
        assert paused > 0 and resumed == paused  # every pause was lifted
        # Bounded: past the limit a pause goes out; only the thinker steps already under way when
        # it arrives follow (a few; up to 12 seen on a loaded 2-core machine with the stages as
        # threads), not the 48 rows of a whole reply.
        assert counters(omni, 1)["max_backlog"] <= limit + 16  # a whole reply would be 48
    for i, (got, ref) in enumerate(zip(streamed, reference, strict=True)):
        assert_same(got, ref, f"prompt {i}")
