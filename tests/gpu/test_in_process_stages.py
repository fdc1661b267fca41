"""Stages as threads of one process on one GPU (`runtime.process: false`) with their CUDA graphs:
the pipeline starts (each stage captures its graphs while the other may run; captures go one
at a time, graph_capture.capturing), each stage runs on its own CUDA stream
(stage_launcher._own_cuda_stream), and the audio equals that of stage processes."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.models.test_qwen3_tts import CASES, SEED, case_prompt  # noqa: E402
from tests.models.test_qwen3_tts_pipeline import GREEDY  # noqa: E402
from vllm_omni import Omni  # noqa: E402


def speak(model, process: bool) -> dict[str, torch.Tensor]:
    overrides = {stage: {"process": process, "max_num_seqs": 4} for stage in "01"}  # the deploy config's memory shares
    with Omni(model=str(model), stage_overrides=overrides) as omni:
        pids = {h.pid for h in omni.stage_health()}
        assert (pids == {os.getpid()}) is not process
        outputs = omni.generate([case_prompt("CustomVoice", c) for c in CASES["CustomVoice"]], GREEDY,
                                use_tqdm=False)
    assert all(out.error is None for out in outputs)
    return {out.request_id: out.request_output.outputs[0].multimodal_output["audio"] for out in outputs}


def test_tts_stages_as_threads_with_graphs_speak_as_stage_processes(tiny_model):
    model = tiny_model("qwen3_tts", seed=SEED, task_type="CustomVoice")
    threads, processes = speak(model, process=False), speak(model, process=True)
    assert sorted(threads) == sorted(processes)
    for rid, audio in processes.items():
        assert audio.numel() > 0
        torch.testing.assert_close(threads[rid], audio, atol=1e-4, rtol=0)
