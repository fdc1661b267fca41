"""The stage-process profiler of the GPU benchmarks (engine/step_profiler.py), on the CPU: the
named stage alone writes its profile after the asked steps, and the outputs are unchanged."""
from __future__ import annotations

from tests.e2e.conftest import by_request, short_params, user
from vllm_omni import Omni
from vllm_omni.engine import step_profiler


def test_a_named_stage_writes_its_profile(omni_dir, tmp_path, monkeypatch):
    prompts = [{"messages": user({"type": "text", "text": "Say something."})}]
    params = short_params(thinker=8, talker=16)
    with Omni(model=str(omni_dir)) as omni:
        reference = by_request(omni.generate(prompts, params, use_tqdm=False))
    for name, value in {step_profiler.DIR_ENV: str(tmp_path), step_profiler.STAGES_ENV: "1",
                        step_profiler.SKIP_ENV: "2", step_profiler.STEPS_ENV: "5"}.items():
        monkeypatch.setenv(name, value)  # the stage processes inherit them
    with Omni(model=str(omni_dir)) as omni:
        profiled = by_request(omni.generate(prompts, params, use_tqdm=False))
    assert [p.name for p in tmp_path.iterdir()] == ["stage1-profile.txt"]  # the talker alone
    text = (tmp_path / "stage1-profile.txt").read_text()
    assert text.startswith("stage 1: steps 2..6\nwall per step: ") and "top ops by self CPU time" in text
    assert "aten::" in text
    codes = [r["audio"].request_output.prompt_token_ids for r in (reference[0], profiled[0])]
    assert codes[0] == codes[1]
