"""Sleep mode on a GPU (the demo model: thinker, talker with CUDA graphs, token2wav): sleeping gives
the device memory of every stage back (their weights, KV caches, graphs and allocator caches;
their CUDA contexts stay), and waking at level 1 and level 2 gives the same text and audio.

Device memory is read in this process with torch.cuda.mem_get_info, which counts every process
on the device. The numbers are printed (`-s`) for docs/benchmarks.md."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni import Omni  # noqa: E402
from vllm_omni.testing import demo_model_path  # noqa: E402

# What a stage keeps while it sleeps: its CUDA context and the kernels loaded into it.
CONTEXT_GIB = 1.0
PARAMS = [{"max_tokens": 8, "min_tokens": 8, "temperature": 0.0}, {"max_tokens": 48, "min_tokens": 48}, None]


def _used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def _answer(omni: Omni) -> tuple[list[int], torch.Tensor]:
    outs = {o.final_output_type: o for o in omni.generate([{"prompt": "Hello there."}], PARAMS, use_tqdm=False)}
    audio = outs["audio"].request_output.outputs[0].multimodal_output["audio"].float().cpu()
    return outs["text"].request_output.outputs[0].token_ids, audio


def test_sleep_gives_the_memory_back_and_both_levels_wake_to_the_same_outputs():
    baseline = _used_gib()
    # CUDA graphs, captured again on wake-up; KV pools for 1024 sequences of the demo's 4096 positions
    # (the thinker's 2 GiB in float32), so that a stage which kept its cache while asleep shows.
    overrides = {stage: {"enforce_eager": False, "max_num_seqs": 1024} for stage in "01"}
    with Omni(str(demo_model_path()), enable_sleep_mode=True, stage_overrides=overrides) as omni:
        before = _answer(omni)
        awake = _used_gib()
        held = awake - baseline
        stages = len(omni.stage_health())
        assert held > stages * CONTEXT_GIB + 2.0  # the KV caches are most of it
        for level in (1, 2):
            omni.sleep(level)
            asleep = _used_gib()
            print(f"level {level}: the stages held {held:.2f} GiB, asleep {asleep - baseline:.2f} GiB")
            assert asleep - baseline < stages * CONTEXT_GIB
            omni.wake_up()
            assert _used_gib() - baseline > held - 1.0  # everything is back
            text, audio = _answer(omni)
            assert text == before[0] and torch.equal(audio, before[1]), f"level {level}"
