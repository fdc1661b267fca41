"""Stages as threads of one process on one GPU (`runtime.process: false`) with their CUDA graphs:
the pipeline starts (each stage captures its graphs while the other may run; captures go one
at a time, graph_capture.capturing), each stage runs on its own CUDA stream
(stage_launcher._own_cuda_stream), and the talker's codes and the audio equal those of stage
processes.

The code2wav stage computes in float32 here (`dtype: float32`; its CUDA default is TF32). Which
streams share a decode call, and so the rows and frames of the graph a chunk replays and where
its vocoder starts, depends on when the talker's frames arrive: threads running side by side
and processes taking turns on the GPU (and two runs of either) batch differently. In float32
that moves a chunk's samples by rounding only (the CPU: <= 6.6e-7 between threads and processes;
tests/gpu/test_code2wav_precision.py: 1e-5 alone vs batched); in TF32 by TF32's rounding (a
shape whose kernel rounds its inputs to TF32 against one whose kernel does not): on the H200,
22.7% of the samples moved, by up to 2.2e-3 of a +-1 waveform, with the same codes. A fault of
the thread path (a wrong batch, streams racing) moves them by the signal's size.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.models.test_qwen3_tts import CASES, SEED, case_prompt  # noqa: E402
from tests.models.test_qwen3_tts_pipeline import GREEDY  # noqa: E402
from vllm_omni import Omni  # noqa: E402


def speak(model, process: bool) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Each request's codes (code2wav's input) and audio."""
    overrides = {stage: {"process": process, "max_num_seqs": 4} for stage in "01"}  # the deploy config's memory shares
    overrides["1"]["dtype"] = "float32"  # see the module docstring
    with Omni(model=str(model), stage_overrides=overrides) as omni:
        pids = {h.pid for h in omni.stage_health()}
        assert (pids == {os.getpid()}) is not process
        outputs = omni.generate([case_prompt("CustomVoice", c) for c in CASES["CustomVoice"]], GREEDY,
                                use_tqdm=False)
    assert all(out.error is None for out in outputs)
    return {out.request_id: (out.request_output.prompt_token_ids,
                             out.request_output.outputs[0].multimodal_output["audio"]) for out in outputs}


def test_tts_stages_as_threads_with_graphs_speak_as_stage_processes(tiny_model):
    model = tiny_model("qwen3_tts", seed=SEED, task_type="CustomVoice")
    threads, processes = speak(model, process=False), speak(model, process=True)
    assert sorted(threads) == sorted(processes)
    for rid, (codes, audio) in processes.items():
        assert audio.numel() > 0
        assert threads[rid][0] == codes, rid
        torch.testing.assert_close(threads[rid][1], audio, atol=1e-4, rtol=0, msg=rid)
