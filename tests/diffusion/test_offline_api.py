"""Offline image generation: `Omni(model).generate(...)` (its stage a thread) and
`vllm-omni generate MODEL --prompt ... -o out.png` (a real process with a stage process),
checked against diffusers' pipeline."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import in_threads
from tests.diffusion.conftest import BATCH_TOLERANCE, Case
from vllm_omni.multimodal.diffusion_prompt import to_pil_image
from vllm_omni.sampling_params import DiffusionSamplingParams, SamplingParams

PARAMS = dict(height=32, width=48, num_inference_steps=2, seed=3)
REPO = Path(__file__).resolve().parents[2]


def test_omni_generates_images_like_diffusers(qwen_image_dir, t2i_pipe):
    from vllm_omni import Omni

    with Omni(str(qwen_image_dir), stage_overrides=in_threads(1)) as omni:
        assert omni.output_modalities == ["image"]
        outs = omni.generate([{"prompt": "a red fox", "negative_prompt": "blurry"}, "a cat"],
                             DiffusionSamplingParams(**PARAMS), use_tqdm=False)
        as_dict = omni.generate("a cat", {**PARAMS, "num_outputs_per_prompt": 2}, use_tqdm=False)[0]
        for bad, match in ((SamplingParams(), "must be DiffusionSamplingParams"), ({"height": 33}, "multiple of 16"),
                           ({"steps": 3}, r"unknown field\(s\) \['steps'\]")):
            with pytest.raises(ValueError, match=match):
                omni.generate("x", bad, use_tqdm=False)
        with pytest.raises(ValueError, match="diffusion model: give a text prompt"):
            omni.generate({"prompt_token_ids": [1, 2]}, use_tqdm=False)
        failed = omni.generate({"prompt": "x", "multi_modal_data": {"image": np.zeros((8, 8, 3), np.uint8)}},
                               DiffusionSamplingParams(**PARAMS), use_tqdm=False)[0]
    assert [o.final_output_type for o in outs] == ["image", "image"]
    for out, case in zip(outs, (Case("0", "a red fox", "blurry", params=PARAMS), Case("1", "a cat", params=PARAMS))):
        image = out.request_output.outputs[0].multimodal_output["image"]
        assert (image - case.reference(t2i_pipe)).abs().max() <= BATCH_TOLERANCE
    pair = as_dict.request_output.outputs[0].multimodal_output["image"]
    assert pair.shape == (2, 3, 32, 48)
    # The stage process runs torch with its own thread count: matmuls may round differently there.
    reference = Case("n", "a cat", params={**PARAMS, "num_outputs_per_prompt": 2}).reference(t2i_pipe)
    assert (pair - reference).abs().max() <= BATCH_TOLERANCE
    assert "takes no input image" in failed.error


def test_cli_generate_writes_the_images(qwen_image_dir, tmp_path, t2i_pipe):
    target = tmp_path / "fox.png"
    cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "generate", str(qwen_image_dir), "--prompt",
           "a red fox", "--negative-prompt", "blurry", "--height", "32", "--width", "48", "--num-inference-steps",
           "2", "--seed", "3", "--num-images-per-prompt", "2", "-o", str(target)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"[0] image: {target} (48x32)" in proc.stdout
    reference = Case("r", "a red fox", "blurry", params={**PARAMS, "num_outputs_per_prompt": 2}).reference(t2i_pipe)
    for path, expected in zip((target, tmp_path / "fox_1.png"), reference):
        written = np.asarray(Image.open(path), dtype=np.int16)
        # PNG holds 8-bit pixels: equal after rounding, give or take one level where the float is on an edge.
        assert written.shape == (32, 48, 3)
        assert np.abs(written - np.asarray(to_pil_image(expected), dtype=np.int16)).max() <= 1
    # A normal run says nothing alarming (issue 40): no "pip install accelerate" per diffusers
    # component, no "leaked semaphore objects" left by the stage process's progress bars.
    for noise in ("accelerate", "leaked semaphore"):
        assert noise not in proc.stderr, proc.stderr
