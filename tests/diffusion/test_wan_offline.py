"""Offline video generation with real stage processes: `Omni(DIR).generate(...)` returns
diffusers' video, and `vllm-omni generate DIR --prompt ... -o out.mp4` writes it as an MP4."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from tests.diffusion.conftest import (MP4_SAME_VIDEO_LEVELS, VIDEO_TOLERANCE, WanCase, decode_mp4, mp4_levels_from,
                                      random_image)

PARAMS = {"num_frames": 5, "height": 32, "width": 48, "num_inference_steps": 3, "seed": 4}


@pytest.fixture(scope="module")
def a14b_omni(wan_dir):
    from vllm_omni import Omni

    with Omni(str(wan_dir("a14b"))) as omni:
        yield omni


def test_omni_generates_the_video_diffusers_makes(a14b_omni, wan_pipes):
    assert a14b_omni.output_modalities == ["video"]
    out = a14b_omni.generate({"prompt": "a red fox", "negative_prompt": "blurry"}, PARAMS, use_tqdm=False)[0]
    assert out.error is None and out.final_output_type == "video"
    video = out.request_output.outputs[0].multimodal_output["video"]
    assert video.shape == (1, 5, 3, 32, 48) and 0 <= video.min() and video.max() <= 1
    reference = WanCase("r", "a red fox", "blurry", params=PARAMS).reference(wan_pipes("a14b"))
    assert (video - reference).abs().max() <= VIDEO_TOLERANCE
    failed = a14b_omni.generate({"prompt": "x", "multi_modal_data": {"image": np.zeros((8, 8, 3), np.uint8)}},
                                PARAMS, use_tqdm=False)[0]
    assert "takes no input image" in failed.error
    with pytest.raises(ValueError, match="num_frames"):
        a14b_omni.generate("x", {**PARAMS, "num_frames": 0}, use_tqdm=False)


def test_cli_generate_writes_an_mp4(wan_dir, wan_pipes, tmp_path, capsys):
    """TI2V-5B from an image file: 24 fps, the frames diffusers makes (up to H.264's loss)."""
    from vllm_omni.entrypoints.cli.main import main

    image = tmp_path / "first.png"
    Image.fromarray(random_image(64, 64, seed=5).numpy()).save(image)
    target = tmp_path / "boat.mp4"
    assert main(["generate", str(wan_dir("ti2v")), "--prompt", "a boat", "--image", str(image), "--num-frames", "5",
                 "--height", "64", "--width", "64", "--num-inference-steps", "2", "--seed", "3", "-o",
                 str(target)]) == 0
    assert f"[0] video: {target} (64x64, 5 frames at 24 fps)" in capsys.readouterr().out
    frames, rate = decode_mp4(target)
    assert frames.shape == (5, 64, 64, 3) and rate == 24
    case = WanCase("r", "a boat", image=random_image(64, 64, seed=5),
                   params={**PARAMS, "height": 64, "width": 64, "num_inference_steps": 2, "seed": 3})
    assert mp4_levels_from(target, case.reference(wan_pipes("ti2v"))[0]) < MP4_SAME_VIDEO_LEVELS
