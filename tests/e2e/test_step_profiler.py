"""The stage-process profiler of the GPU benchmarks (engine/step_profiler.py), on the CPU: the
named stage alone writes its profile after the asked steps (or when it stops first), with a
timeline of its steps, and the outputs are unchanged. The first test runs the profiled talker as
a stage process (it inherits the variables; the thinker and code2wav, threads that read the same
variables, must not profile); the timeline-only ones run the same stage loop as threads."""
from __future__ import annotations

from tests.conftest import in_threads
from tests.e2e.conftest import by_request, short_params, user
from vllm_omni import Omni
from vllm_omni import envs


def test_a_named_stage_writes_its_profile(omni_dir, omni25, tmp_path, monkeypatch):
    prompts = [{"messages": user({"type": "text", "text": "Say something."})}]
    params = short_params(thinker=8, talker=16)
    reference = by_request(omni25.generate(prompts, params, use_tqdm=False))  # the package's pipeline, unprofiled
    for name, value in {envs.PROFILE_DIR.name: str(tmp_path), envs.PROFILE_STAGES.name: "1",
                        envs.PROFILE_SKIP.name: "2", envs.PROFILE_STEPS.name: "5"}.items():
        monkeypatch.setenv(name, value)  # the talker's process inherits them
    with Omni(model=str(omni_dir), stage_overrides={"0": {"process": False}, "2": {"process": False}}) as omni:
        profiled = by_request(omni.generate(prompts, params, use_tqdm=False))
    assert [p.name for p in tmp_path.iterdir()] == ["stage1-profile.txt"]  # the talker alone
    text = (tmp_path / "stage1-profile.txt").read_text()
    assert text.startswith("stage 1: steps 2..6\nwall per step: ") and "top ops by self CPU time" in text
    assert "aten::" in text
    timeline = text.split("timeline (ms from the first profiled step: start +duration, outputs sent):\n")[1]
    steps = timeline.splitlines()
    assert [line.split(":")[0].strip() for line in steps] == [f"step {i}" for i in range(2, 7)]
    # One request streams at most one output a step. On a busy machine the talker may also spend a
    # step on a part of its prompt that has just streamed in from the thinker, and send nothing.
    sent = [int(line.rsplit("(", 1)[1].rstrip(")")) for line in steps]
    assert set(sent) <= {0, 1} and sent[-1] == 1, timeline
    codes = [r["audio"].request_output.prompt_token_ids for r in (reference[0], profiled[0])]
    assert codes[0] == codes[1]


def test_a_stage_that_stops_first_writes_its_timeline(omni_dir, tmp_path, monkeypatch):
    for name, value in {envs.PROFILE_DIR.name: str(tmp_path), envs.PROFILE_STAGES.name: "2",
                        envs.PROFILE_SKIP.name: "0", envs.PROFILE_STEPS.name: "100000",
                        envs.PROFILE_OPS.name: "0"}.items():
        monkeypatch.setenv(name, value)
    with Omni(model=str(omni_dir), stage_overrides=in_threads(3)) as omni:
        omni.generate([{"messages": user({"type": "text", "text": "Hi."})}], short_params(thinker=4, talker=8),
                      use_tqdm=False)
    text = (tmp_path / "stage2-profile.txt").read_text()  # written when code2wav shut down
    assert "aten::" not in text  # no torch profiler
    timeline = text.split("outputs sent):\n")[1].splitlines()
    assert timeline and timeline[0].startswith("  step 0: ")


def test_per_stage_skips_and_the_python_profile(omni_dir, tmp_path, monkeypatch):
    for name, value in {envs.PROFILE_DIR.name: str(tmp_path), envs.PROFILE_STAGES.name: "0,1",
                        envs.PROFILE_SKIP.name: "0:1,1:3", envs.PROFILE_STEPS.name: "2",
                        envs.PROFILE_OPS.name: "0", envs.PROFILE_PYTHON.name: "1"}.items():
        monkeypatch.setenv(name, value)
    with Omni(model=str(omni_dir), stage_overrides=in_threads(3)) as omni:
        omni.generate([{"messages": user({"type": "text", "text": "Hi."})}], short_params(thinker=8, talker=8),
                      use_tqdm=False)
    thinker, talker = ((tmp_path / f"stage{i}-profile.txt").read_text() for i in (0, 1))
    assert thinker.startswith("stage 0: steps 1..2\n") and talker.startswith("stage 1: steps 3..4\n")
    for text in (thinker, talker):  # cProfile's tables name our own functions
        assert "python functions by tottime:" in text and "python functions by cumulative:" in text
        assert "llm_engine.py" in text and "aten::" not in text
