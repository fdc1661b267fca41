"""--enable-layerwise-offload on the CPU: the same hooks and copies as on a GPU (synchronous here).
Outputs equal those without offload, each block's weights come from its CPU copy just before it
runs (the next block's while one runs), and the offloaded blocks share a ring of two buffers.
The tiny Qwen-Image server of tests/server/test_images_api.py runs with it: its images equal
diffusers' own."""
from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

from tests.diffusion.conftest import Case, image_of, run_engine
from vllm_omni.diffusion.process_group import ModelSpec
from vllm_omni.diffusion.layerwise_offload import LayerwiseOffload


class Block(nn.Module):
    def __init__(self, dim: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("scale", torch.rand(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.tanh(self.proj(x))) * self.scale


def _stack(n: int = 5, dim: int = 24) -> nn.Sequential:
    return nn.Sequential(*(Block(dim, seed) for seed in range(n)))


def test_blocks_are_copied_in_before_they_run_and_outputs_are_equal():
    reference = _stack()
    blocks = copy.deepcopy(reference)
    offload = LayerwiseOffload.install(list(blocks), torch.device("cpu"))
    offload.trace = []
    x = torch.randn(3, 24)
    with torch.inference_mode():
        assert torch.equal(blocks(x), reference(x))
        first = list(offload.trace)
        assert torch.equal(blocks(x * 2), reference(x * 2))
    # The first block stays; block j of the 4 offloaded ones is copied in while the one before it
    # runs (the last one prefetches the first for the next forward).
    assert first == [("copy", 0), ("run", 0), ("copy", 1), ("run", 1), ("copy", 2), ("run", 2), ("copy", 3),
                     ("run", 3), ("copy", 0)]
    assert offload.trace[len(first):] == first[1:]  # block 0 was prefetched by the last forward
    # Two slots for four blocks: blocks j and j + 2 are views of the same memory.
    ptr = [b.proj.weight.untyped_storage().data_ptr() for b in blocks]
    assert ptr[1] == ptr[3] and ptr[2] == ptr[4] and ptr[1] != ptr[2]
    assert blocks[0].proj.weight.untyped_storage().data_ptr() not in ptr[1:]


def test_the_weights_come_from_the_cpu_copy_each_time():
    blocks = _stack()
    offload = LayerwiseOffload.install(list(blocks), torch.device("cpu"))
    x = torch.randn(3, 24)
    with torch.inference_mode():
        before = blocks(x)
        offload.blocks[2].host.zero_()  # block 3's weights, as the ring will copy them next time
        assert not torch.equal(blocks(x), before)


def test_blocks_run_out_of_order_are_still_loaded():
    reference = _stack()
    blocks = copy.deepcopy(reference)
    LayerwiseOffload.install(list(blocks), torch.device("cpu"))
    x = torch.randn(2, 24)
    with torch.inference_mode():
        for order in ([0, 3, 1], [4, 2, 2, 0]):
            a, b = x, x
            for i in order:
                a, b = blocks[i](a), reference[i](b)
            assert torch.equal(a, b)


def test_a_model_without_offload_support_is_refused_by_name():
    spec = ModelSpec("tests.diffusion.test_layerwise_offload:NoOffloadModel", "unused", "float32",
                     layerwise_offload=True)
    with pytest.raises(ValueError, match="enable_layerwise_offload: NoOffloadModel does not support it"):
        spec.build(torch.device("cpu"))


class NoOffloadModel:
    @classmethod
    def load(cls, model_path, *, device, dtype, dummy, vae_use_slicing, vae_use_tiling, cpu_offload, acceleration):
        raise AssertionError("not reached")


def test_the_diffusers_adapter_offloads_with_diffusers_group_offload(qwen_image_dir, t2i_pipe):
    from vllm_omni.config import load_pipeline_config
    from vllm_omni.worker.gpu_diffusion_worker import GPUDiffusionWorker

    stage = load_pipeline_config(model=qwen_image_dir, platform="cpu", cli_args={
        "diffusion_load_format": "diffusers", "enable_layerwise_offload": True,
        "diffusers_load_kwargs": {"dtype": torch.float32}}).stage(0)
    worker = GPUDiffusionWorker(stage, str(qwen_image_dir), device="cpu")
    if importlib.util.find_spec("accelerate") is None:  # not a dependency: diffusers needs it for this
        with pytest.raises(ValueError, match="needs the accelerate package"):
            worker.build_engine()
        return
    engine = worker.build_engine()
    assert engine.pipe.transformer.transformer_blocks[0]._diffusers_hook.get_hook("group_offloading") is not None
    case = Case("r", "a red fox", params=dict(height=32, width=32, num_inference_steps=2, seed=4))
    assert torch.equal(image_of(run_engine(engine, [case])["r"]), case.reference(t2i_pipe))


def test_wan_offloads_each_experts_blocks_and_its_video_is_unchanged(wan_dir, wan_model):
    """Wan2.2 A14B: each expert's blocks get a ring of their own; a request crossing the expert
    boundary copies both experts' blocks in and makes the video the model makes without offload."""
    from tests.diffusion.conftest import WanCase, video_of
    from vllm_omni.diffusion.engine import DiffusionEngine
    from vllm_omni.model_executor.models.wan2_2.model import WanModel

    offloads = []

    def offload_blocks(blocks, device):
        offloads.append(LayerwiseOffload.install(blocks, device))

    model = WanModel.load(wan_dir("a14b"), device=torch.device("cpu"), dtype=torch.float32,
                          offload_blocks=offload_blocks)
    assert len(offloads) == 2 and all(o.blocks for o in offloads)
    case = WanCase("a", "a red fox running in the snow",
                   params=dict(height=32, width=48, num_frames=5, num_inference_steps=4, guidance_scale=4.0, seed=5))
    video = video_of(run_engine(DiffusionEngine(model, stage_id=0, max_batch_size=2), [case])["a"])
    assert all(o.copies > 0 for o in offloads)
    reference = video_of(run_engine(DiffusionEngine(wan_model("a14b"), stage_id=0, max_batch_size=2), [case])["a"])
    assert torch.equal(video, reference)


def test_fp8_blocks_are_offloaded_as_they_are(qwen_image_dir, make_engine):
    """Online FP8 quantizes the blocks before they are offloaded: the ring holds their float8 weights
    and scales, and the image equals the FP8 model's without offload."""
    from vllm_omni.model_executor.models.diffusion_quantization_spec import DiffusionQuantization
    from vllm_omni.model_executor.layers.fp8_linear import Fp8Linear
    from vllm_omni.model_executor.models.diffusion_acceleration import DenoiserAcceleration
    from vllm_omni.model_executor.models.qwen_image.model import QwenImageModel

    fp8 = DenoiserAcceleration(quantization=DiffusionQuantization("fp8"))
    offloads = []
    load = dict(device=torch.device("cpu"), dtype=torch.float32, acceleration=fp8)
    offloaded = QwenImageModel.load(qwen_image_dir, **load,
                                    offload_blocks=lambda blocks, device: offloads.append(
                                        LayerwiseOffload.install(blocks, device)))
    tensors = [t for b in offloads[0].blocks for t, _ in b.tensors]
    assert any(t.dtype == torch.float8_e4m3fn for t in tensors)
    assert any(isinstance(m, Fp8Linear) for m in offloaded.blocks[1].modules())
    case = Case("q", "a red fox in the snow", params=dict(height=64, width=64, num_inference_steps=3, seed=3))
    image = image_of(run_engine(make_engine(offloaded), [case])["q"])
    assert offloads[0].copies > 0
    reference = image_of(run_engine(make_engine(QwenImageModel.load(qwen_image_dir, **load)), [case])["q"])
    assert torch.equal(image, reference)
