"""Tiny Qwen-Image pipelines, our stage model on them, diffusers' own pipelines as the reference.

Everything runs on the CPU in float32. A request is built the way the prompt processor builds
it (text, `negative_prompt` in additional_information, the edit image as an HxWx3 uint8 tensor).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from vllm_omni.sampling_params import DiffusionSamplingParams
from vllm_omni.stage_io import StageOutput, StageRequest

# Max abs pixel difference (images in [0, 1]) allowed where our forward batches rows that
# diffusers runs separately (a batch, or CFG's two branches in one forward): float32 matmuls of
# other shapes round differently in the last bits. Solo runs without CFG are compared exactly.
BATCH_TOLERANCE = 1e-5


@dataclass
class Case:
    """One request, as our engine gets it and as diffusers' pipeline is called with it."""

    request_id: str
    prompt: str
    negative: str | None = None
    image: torch.Tensor | None = None  # uint8 [H, W, 3]
    params: dict[str, Any] = field(default_factory=dict)

    def request(self) -> StageRequest:
        info = {"negative_prompt": self.negative} if self.negative is not None else {}
        mm = {"image": self.image} if self.image is not None else None
        return StageRequest(request_id=self.request_id, prompt_token_ids=[], prompt=self.prompt,
                            sampling_params=DiffusionSamplingParams(**self.params), additional_information=info,
                            multi_modal_data=mm)

    def reference(self, pipe: Any) -> torch.Tensor:
        from PIL import Image

        p = DiffusionSamplingParams(**self.params)
        kwargs = dict(prompt=self.prompt, negative_prompt=self.negative, true_cfg_scale=p.true_cfg_scale,
                      height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                      num_images_per_prompt=p.num_outputs_per_prompt,
                      generator=torch.Generator().manual_seed(p.seed), output_type="pt")
        if self.image is not None:
            kwargs["image"] = Image.fromarray(self.image.numpy())
        with torch.no_grad():
            return pipe(**kwargs).images


def run_engine(engine: Any, cases: list[Case], join_after: dict[str, int] | None = None,
               max_steps: int = 200) -> dict[str, StageOutput]:
    """Step the engine until every request finished; `join_after[id] = k` adds that request after k steps."""
    join_after = join_after or {}
    outputs: dict[str, StageOutput] = {}
    for step in range(max_steps):
        for case in cases:
            if join_after.get(case.request_id, 0) == step:
                engine.add_request(case.request())
        if step >= max(join_after.values(), default=0) and not engine.has_work():
            return outputs
        for out in engine.step():
            outputs[out.request_id] = out
    raise AssertionError(f"the engine did not finish within {max_steps} steps")


def image_of(out: StageOutput) -> torch.Tensor:
    assert out.error is None, out.error
    assert out.finished
    return out.multimodal_output["image"]


def random_image(height: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="session")
def qwen_image_dir(tiny_model) -> Path:
    return tiny_model("qwen_image")


@pytest.fixture(scope="session")
def qwen_image_edit_dir(tiny_model) -> Path:
    return tiny_model("qwen_image_edit")


@pytest.fixture(scope="session")
def t2i_model(qwen_image_dir):
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    return QwenImageModel.load(qwen_image_dir, device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="session")
def t2i_pipe(qwen_image_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(qwen_image_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def make_engine(t2i_model):
    from vllm_omni.diffusion.engine import DiffusionEngine

    def make(model: Any = None, **kwargs: Any) -> DiffusionEngine:
        kwargs.setdefault("max_batch_size", 4)
        return DiffusionEngine(model or t2i_model, stage_id=0, **kwargs)

    return make


# --- Wan2.2 (video): one tiny checkpoint, model and diffusers pipeline per layout per session -------
# Max abs pixel difference (videos in [0, 1]) allowed against diffusers' pipeline (issue 45:
# 2e-3 in float32). Measured: ~1e-6, float32 matmuls of other batch shapes rounding differently.
VIDEO_TOLERANCE = 2e-3
WAN_SIZES = {"a14b": dict(height=32, width=48), "i2v": dict(height=32, width=48), "ti2v": dict(height=64, width=64)}


@dataclass
class WanCase(Case):
    """One video request (`image`: its first frame), as our engine gets it and as diffusers' Wan
    pipeline is called with it."""

    def reference(self, pipes: dict[str, Any]) -> torch.Tensor:
        """diffusers' frames [n, F, 3, H, W]; `pipes`: the layout's {"t2v": ..., "i2v": ...}."""
        from PIL import Image

        p = DiffusionSamplingParams(**self.params)
        kwargs = dict(prompt=self.prompt, negative_prompt=self.negative, height=p.height, width=p.width,
                      num_frames=p.num_frames, num_inference_steps=p.num_inference_steps,
                      num_videos_per_prompt=p.num_outputs_per_prompt,
                      generator=torch.Generator().manual_seed(p.seed), output_type="pt")
        for name in ("guidance_scale", "guidance_scale_2"):
            if getattr(p, name) is not None:
                kwargs[name] = getattr(p, name)
        if self.image is not None:
            kwargs["image"] = Image.fromarray(self.image.numpy())
        pipe = pipes["t2v" if self.image is None else "i2v"]
        with torch.no_grad():
            return torch.as_tensor(pipe(**kwargs).frames)


def video_of(out: StageOutput) -> torch.Tensor:
    assert out.error is None, out.error
    assert out.finished
    return out.multimodal_output["video"]


def _memo(build: Any) -> Any:
    """A session factory: build(layout) once per layout, on first use."""
    built: dict[str, Any] = {}

    def get(layout: str) -> Any:
        if layout not in built:
            built[layout] = build(layout)
        return built[layout]

    return get


@pytest.fixture(scope="session")
def wan_dir(tiny_model):
    """wan_dir(layout) -> the tiny Wan2.2 folder of that layout (a14b, i2v, ti2v)."""
    return _memo(lambda layout: tiny_model("wan2_2", layout=layout))


@pytest.fixture(scope="session")
def wan_model(wan_dir):
    """wan_model(layout) -> our WanModel on it (CPU, float32)."""
    from vllm_omni.model_executor.models.wan2_2.model import WanModel

    return _memo(lambda layout: WanModel.load(wan_dir(layout), device=torch.device("cpu"), dtype=torch.float32))


@pytest.fixture(scope="session")
def wan_pipes(wan_dir):
    """wan_pipes(layout) -> diffusers' pipelines on it: {"t2v": WanPipeline} (a14b, ti2v) and
    {"i2v": WanImageToVideoPipeline} (i2v, ti2v: TI2V-5B runs both from one folder, as diffusers
    documents)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    def build(layout: str) -> dict[str, Any]:
        classes = {"a14b": {"t2v": WanPipeline}, "i2v": {"i2v": WanImageToVideoPipeline},
                   "ti2v": {"t2v": WanPipeline, "i2v": WanImageToVideoPipeline}}[layout]
        pipes = {kind: cls.from_pretrained(wan_dir(layout)) for kind, cls in classes.items()}
        for pipe in pipes.values():
            pipe.set_progress_bar_config(disable=True)
        return pipes

    return _memo(build)


# H.264 keeps a random model's noise-like video only approximately (4:2:0 colour, and frames
# that differ by one 8-bit level in a pixel are encoded differently): an MP4 is compared with
# diffusers' video put through the same encoder, by the mean difference of its decoded pixels
# (measured: ~2.5 levels for the same video, ~24 for another seed's).
MP4_SAME_VIDEO_LEVELS = 6.0


def decode_mp4(path: Path) -> tuple[np.ndarray, float]:
    """An MP4's frames [F, H, W, 3] as float64 pixel levels, and its frame rate."""
    import av

    with av.open(str(path)) as container:
        rate = float(container.streams.video[0].average_rate)
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.float64), rate


def mp4_levels_from(path: Path, reference: torch.Tensor) -> float:
    """Mean pixel difference between the MP4 at `path` and `reference` ([F, 3, H, W]) encoded alike."""
    from vllm_omni.multimodal.video_output import write_mp4

    ours, rate = decode_mp4(path)
    write_mp4(reference, path.with_suffix(".reference.mp4"), fps=rate)
    theirs, _ = decode_mp4(path.with_suffix(".reference.mp4"))
    assert ours.shape == theirs.shape
    return float(np.abs(ours - theirs).mean())
