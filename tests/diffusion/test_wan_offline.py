"""Offline video generation with real stage processes: `Omni(DIR).generate(...)` returns
diffusers' video, and `vllm-omni generate DIR --prompt ... -o out.mp4` writes it as an MP4."""
from __future__ import annotations

import numpy as np
import pytest

from tests.diffusion.conftest import MP4_SAME_VIDEO_LEVELS, VIDEO_TOLERANCE, WanCase, decode_mp4, mp4_levels_from

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


def test_cli_generate_writes_an_mp4(a14b_omni, wan_dir, wan_pipes, tmp_path, capsys):
    """`vllm-omni generate DIR ... -o out.mp4` (its diffusion path, on this module's pipeline):
    16 fps, the frames diffusers makes (up to H.264's loss)."""
    from vllm_omni.entrypoints.cli.generate_images import generate_images
    from vllm_omni.entrypoints.cli.main import build_parser

    target = tmp_path / "fox.mp4"
    args = build_parser().parse_args(["generate", str(wan_dir("a14b")), "--prompt", "a fox", "--num-frames", "5",
                                      "--height", "32", "--width", "48", "--num-inference-steps", "3", "--seed", "4",
                                      "--guidance-scale-2", "2.5", "-o", str(target)])
    assert generate_images(a14b_omni, args) == 0
    assert f"[0] video: {target.resolve()} (48x32, 5 frames at 16 fps)" in capsys.readouterr().out
    frames, rate = decode_mp4(target)
    assert frames.shape == (5, 32, 48, 3) and rate == 16
    case = WanCase("r", "a fox", params={**PARAMS, "guidance_scale_2": 2.5})
    assert mp4_levels_from(target, case.reference(wan_pipes("a14b"))[0]) < MP4_SAME_VIDEO_LEVELS
