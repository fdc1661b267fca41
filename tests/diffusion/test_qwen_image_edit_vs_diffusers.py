"""Qwen-Image-Edit on our diffusion engine against diffusers' own QwenImageEditPipeline.

The reference pipeline gets transformers' Qwen2VLProcessor, built here without torchvision the
way tests/multimodal/hf_reference.py builds Omni processors (a stub video processor); our model
has its own expansion of the image placeholder.

The pipeline resizes every input image to about 1024 x 1024 pixels (`calculate_dimensions(1024 *
1024, ratio)`) and VAE-encodes it there, ~30 s per request on a busy 2-core CPU. Here both sides
use a 256 x 256 area instead: our model calls the same diffusers function, so one patch of its
target area changes both identically (the server test runs an edit at the real area).
"""
from __future__ import annotations

import pytest
import torch

from tests.diffusion.conftest import BATCH_TOLERANCE, Case, image_of, random_image, run_engine

IMAGE = random_image(48, 80, seed=7)  # not square: the pipeline derives the output's aspect ratio from it


TEST_AREA = 256 * 256


@pytest.fixture(autouse=True)
def small_condition_area(monkeypatch):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit

    original = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda target_area, ratio: original(TEST_AREA, ratio))


@pytest.fixture(scope="module")
def edit_model(qwen_image_edit_dir):
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    return QwenImageModel.load(qwen_image_edit_dir, device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def edit_pipe(qwen_image_edit_dir):
    from diffusers import QwenImageEditPipeline
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    from tests.multimodal.hf_reference import StubVideoProcessor

    folder = qwen_image_edit_dir / "processor"
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
                                 tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=StubVideoProcessor())
    pipe = QwenImageEditPipeline.from_pretrained(qwen_image_edit_dir, processor=processor)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_edits_equal_diffusers_alone_and_batched(make_engine, edit_model, edit_pipe):
    plain = Case("plain", "make the sky purple", image=IMAGE, params=dict(height=64, width=64, num_inference_steps=2,
                                                                          seed=5))
    guided = Case("guided", "add a small red boat in the water", negative="blurry", image=IMAGE,
                  params=dict(height=64, width=64, num_inference_steps=3, true_cfg_scale=3.0, seed=6))
    references = {c.request_id: c.reference(edit_pipe) for c in (plain, guided)}
    solo = image_of(run_engine(make_engine(edit_model, max_batch_size=1), [plain])["plain"])
    assert torch.equal(solo, references["plain"])
    batched = run_engine(make_engine(edit_model, max_batch_size=2), [plain, guided])
    for rid, reference in references.items():
        assert (image_of(batched[rid]) - reference).abs().max() <= BATCH_TOLERANCE, rid
    assert (references["plain"] - references["guided"]).abs().max() > 0.01


def test_an_edit_needs_an_image(make_engine, edit_model):
    out = run_engine(make_engine(edit_model), [Case("none", "make it red", params=dict(height=32, width=32,
                                                                                        num_inference_steps=2))])
    assert "Qwen-Image-Edit edits an image: the request has none" in out["none"].error


def test_an_edit_prompt_past_the_rotary_positions_fails_with_the_reason(make_engine, edit_model):
    # An edit prompt is not truncated: past the transformer's 4096 rotary positions (less the
    # image's) diffusers would fail inside a step; ours names the limit before any step runs.
    long_prompt = "make it red " * 1400
    ok = Case("ok", "make it red", image=random_image(32, 32), params=dict(num_inference_steps=2, seed=0))
    long = Case("long", long_prompt, image=random_image(32, 32), params=dict(num_inference_steps=2, seed=0))
    out = run_engine(make_engine(edit_model), [ok, long])
    assert "text-encoder tokens with its image; this model places at most" in out["long"].error
    assert out["ok"].error is None
