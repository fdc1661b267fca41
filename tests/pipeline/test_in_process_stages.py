"""Stages in threads of the caller's process (`runtime.process: false`) running at once: each
forward sees its own attention metadata, so the results equal the models run by hand."""
from __future__ import annotations

import os

from tests.pipeline.conftest import assert_matches, random_prompts, run_reference
from tests.pipeline.test_pipeline_e2e import group
from vllm_omni import Omni


def test_two_in_process_stages_at_once_equal_their_solo_runs(toy_pipeline):
    overrides = {"0": {"process": False}, "1": {"process": False}}
    with Omni(model=str(toy_pipeline.thinker), stage_configs_path=str(toy_pipeline.yaml),
              stage_overrides=overrides) as omni:
        assert [h.pid for h in omni.stage_health()][:2] == [os.getpid(), os.getpid()]
        prompts = random_prompts(16, seed=5)
        outputs = omni.generate([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        for outs, ref in zip(group(outputs), run_reference(omni.pipeline, prompts), strict=True):
            assert_matches(outs, ref)
