"""Tiny Qwen-Image pipelines, our stage model on them, diffusers' own pipelines as the reference.

Everything runs on the CPU in float32. A request is built the way the prompt processor builds
it (text, `negative_prompt` in additional_information, the edit image as an HxWx3 uint8 tensor).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
