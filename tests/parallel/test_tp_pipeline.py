"""A two-stage Qwen2.5-Omni pipeline (thinker -> talker) through `Omni`, real stage processes,
both stages at TP=2 by `stage_overrides` (a rank process under each stage process), against
the same pipeline at TP=1: thinker text and hidden-state-fed talker codes identical.

Then the failure paths at the stage level: a killed rank of the thinker takes its stage down
(requests that need it fail at once, naming it); a killed stage process takes its rank with
it; closing leaves no process behind.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.conftest import in_threads
from tests.pipeline.conftest import pid_alive, wait_until
from vllm_omni import Omni

TWO_STAGES = """
stage_args:
  - stage_id: 0
    runtime: {process: true, devices: "0", max_batch_size: 4}
    engine_args: {model_stage: thinker, model_arch: Qwen2_5OmniForConditionalGeneration, worker_type: ar,
                  engine_output_type: latent, enable_prefix_caching: false, max_model_len: 512}
    is_comprehension: true
    final_output: true
    final_output_type: text
    default_sampling_params: {temperature: 0.0, max_tokens: 8, repetition_penalty: 1.0}
  - stage_id: 1
    runtime: {process: true, devices: "0", max_batch_size: 4}
    engine_args: {model_stage: talker, model_arch: Qwen2_5OmniForConditionalGeneration, worker_type: ar,
                  engine_output_type: latent, enable_prefix_caching: false, max_model_len: 512}
    engine_input_source: [0]
    custom_process_input_func: vllm_omni.model_executor.stage_input_processors.qwen2_5_omni.thinker2talker
    final_output: true
    final_output_type: text
    default_sampling_params: {temperature: 0.0, max_tokens: 12, repetition_penalty: 1.0}
"""
TP2 = {str(stage): {"tensor_parallel_size": 2, "devices": "0,1"} for stage in (0, 1)}
PROMPTS = [
    "Tell me a story.",
    {"messages": [{"role": "user", "content": "Hello there"}]},
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
]


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp-pipeline") / "two_stages.yaml"
    path.write_text(TWO_STAGES)
    return path


def outputs_by_stage(omni: Omni) -> list[dict[int, tuple[list[int], str]]]:
    outs = omni.generate(PROMPTS, use_tqdm=False)
    assert all(o.finished and o.error is None for o in outs)
    per_request: dict[str, dict[int, tuple[list[int], str]]] = {}
    for o in outs:
        comp = o.request_output.outputs[0]
        per_request.setdefault(o.request_id, {})[o.stage_id] = (comp.token_ids, comp.text)
    return list(per_request.values())


def rank_children(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


def test_tp2_pipeline_equals_tp1_and_dies_cleanly(omni_dir, two_stages):
    with Omni(model=str(omni_dir), stage_configs_path=str(two_stages), stage_overrides=in_threads(2)) as omni:
        expected = outputs_by_stage(omni)  # TP=1, the stages as threads
    assert all(sorted(stages) == [0, 1] and stages[1][0] for stages in expected)  # text and talker codes

    # Without restarts the stage stays down once its rank is lost (supervision is tested in tests/reliability).
    omni = Omni(model=str(omni_dir), stage_configs_path=str(two_stages), stage_overrides=TP2, max_stage_restarts=0)
    stage_pids = [h.pid for h in omni.stage_health()]
    ranks = [rank_children(pid) for pid in stage_pids]
    try:
        assert all(len(r) == 1 for r in ranks), ranks  # one rank process under each stage process
        assert outputs_by_stage(omni) == expected

        os.kill(ranks[0][0], signal.SIGKILL)  # the thinker's rank 1
        assert wait_until(lambda: omni.stage_health()[0].state.value == "down", 15.0)
        assert "tensor-parallel rank 1" in omni.stage_health()[0].reason
        assert wait_until(lambda: not pid_alive(stage_pids[0]), 15.0)  # the stage exits, not just its rank
        failed = omni.generate(PROMPTS[:1], use_tqdm=False)
        assert failed[-1].error is not None and "stage 0" in failed[-1].error

        os.kill(stage_pids[1], signal.SIGKILL)  # the talker's stage process: its rank must follow
        assert wait_until(lambda: not pid_alive(ranks[1][0]), 15.0)
    finally:
        omni.close()
    assert wait_until(lambda: not any(pid_alive(p) for p in stage_pids + sum(ranks, [])), 15.0)
