"""A three-stage pipeline of real processes matches the same models run by hand."""
from __future__ import annotations

import pytest

from tests.pipeline.conftest import assert_matches, random_prompts, run_reference
from vllm_omni import Omni, SamplingParams


@pytest.fixture(scope="module")
def omni(toy_pipeline):
    with Omni(model=str(toy_pipeline.thinker), stage_configs_path=str(toy_pipeline.yaml)) as omni:
        yield omni


def group(outputs):
    """Outputs per request, in prompt order (generate() returns them in that order)."""
    by_request = {}
    for out in outputs:
        by_request.setdefault(out.request_id, []).append(out)
    return list(by_request.values())


def test_three_stages_match_models_run_by_hand(omni):
    tokenizer = omni.get_tokenizer()
    text = "The quick brown fox"
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompts = [text, {"prompt_token_ids": [5, 6, 7]}, {"prompt": "jumps over"}]
    outputs = omni.generate(prompts, use_tqdm=False)
    # One output per final stage per prompt, in prompt order, stage order within a prompt.
    rids = list(dict.fromkeys(o.request_id for o in outputs))
    assert [(o.request_id, o.stage_id) for o in outputs] == [(rid, s) for rid in rids for s in (0, 2)]
    assert all(o.finished and o.error is None for o in outputs)
    refs = run_reference(omni.pipeline, [ids, [5, 6, 7], tokenizer.encode("jumps over", add_special_tokens=False)])
    for outs, ref in zip(group(outputs), refs, strict=True):
        assert_matches(outs, ref)
    assert outputs[0].request_output.prompt == text and outputs[0].request_output.prompt_token_ids == ids


def test_sixteen_concurrent_requests_equal_their_solo_runs(omni):
    prompts = random_prompts(16, seed=3)
    outputs = omni.generate([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    refs = run_reference(omni.pipeline, prompts)
    for outs, ref in zip(group(outputs), refs, strict=True):
        assert_matches(outs, ref)


def test_py_generator_and_per_request_sampling_params(omni):
    params = [SamplingParams(temperature=0.0, max_tokens=3), None, None]
    gen = omni.generate([{"prompt_token_ids": [9, 8, 7]}] * 2, params, py_generator=True, use_tqdm=False)
    outputs = list(gen)
    assert len(outputs) == 4
    for out in outputs:
        if out.stage_id == 0:
            assert len(out.request_output.outputs[0].token_ids) == 3
        else:  # 3 stage-0 tokens + 6 stage-1 tokens (its default max_tokens), 8 samples each
            assert out.request_output.outputs[0].multimodal_output["waveform"].numel() <= (3 + 6) * 8


def test_bad_input_is_rejected_before_submission(omni):
    with pytest.raises(ValueError, match="sampling_params_list has 1 entries"):
        omni.generate("hi", [SamplingParams()])
    with pytest.raises(ValueError, match="prompt has unknown key"):
        omni.generate({"text": "hi"})


def test_a_failing_request_fails_alone(omni):
    # A prompt longer than max_model_len (256) fails in stage 0; the others are unaffected.
    outputs = omni.generate([{"prompt_token_ids": [5] * 300}, {"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)
    failed, ok = group(outputs)
    assert len(failed) == 1 and failed[0].stage_id == 0
    assert "max_model_len" in failed[0].error and failed[0].request_output.outputs[0].finish_reason == "error"
    assert [o.stage_id for o in ok] == [0, 2] and all(o.error is None for o in ok)


def test_health_and_stats(omni):
    health = omni.stage_health()
    assert [(h.stage_id, h.state.value) for h in health] == [(0, "up"), (1, "up"), (2, "up")]
    assert [h.model_stage for h in health] == ["thinker", "talker", "code2wav"]
    stats = omni.get_stage_stats(0)
    assert stats.num_unfinished == 0 and stats.kv_free_blocks == stats.kv_total_blocks
    assert omni.get_stage_stats(2).num_waiting == 0
