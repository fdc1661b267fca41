"""Diffusion parallelism on CUDA: the attention kernels that return a log-sum-exp (ring attention),
and tiny Qwen-Image worlds over NCCL against one GPU's images (compiled blocks, float32 with
TeaCache and bfloat16): Ulysses 2 with HSDP and a patch-parallel VAE; ring 2; Ulysses 2 x ring 2.
The multi-GPU tests skip without enough GPUs."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.diffusion.conftest import Case, image_of, run_engine  # noqa: E402
from vllm_omni.config import load_pipeline_config  # noqa: E402
from vllm_omni.model_executor.layers.ring_attention import attention_with_lse  # noqa: E402
from vllm_omni.worker.gpu_diffusion_worker import GPUDiffusionWorker  # noqa: E402

IMAGE_ATOL = {"float32": 1e-3, "bfloat16": 0.05}  # as tests/gpu/test_diffusion_compiled.py


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_attention_with_lse_matches_the_math(dtype):
    generator = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 3, length, 64, device="cuda", generator=generator).to(dtype) for length in (37, 53, 53))
    out, lse = attention_with_lse(q, k, v)
    scores = (q.double() @ k.double().transpose(-1, -2)) / 8
    atol = 1e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(lse, scores.logsumexp(-1).float(), atol=atol, rtol=0)
    torch.testing.assert_close(out.double(), torch.softmax(scores, -1) @ v.double(), atol=atol, rtol=0)


def _engine(model_dir, devices: int, dtype: str, **parallel):
    cli = dict(dtype=dtype, enforce_eager=False, **parallel)
    overrides = {"0": {"devices": ",".join(map(str, range(devices)))}}
    stage = load_pipeline_config(model=model_dir, cli_args=cli, stage_overrides=overrides, platform="cuda").stage(0)
    return GPUDiffusionWorker(stage, str(model_dir), device="cuda").build_engine()


LAYOUTS = {
    "ulysses2_hsdp_vae2": (2, dict(ulysses_degree=2, ulysses_mode="advanced_uaa", use_hsdp=True,
                                   vae_patch_parallel_size=2)),
    "ring2": (2, dict(ring_degree=2, ulysses_mode="advanced_uaa")),
    "ulysses2_ring2": (4, dict(ulysses_degree=2, ring_degree=2, ulysses_mode="advanced_uaa")),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_images_match_one_gpu(tiny_model, name, dtype):
    devices, parallel = LAYOUTS[name]
    if torch.cuda.device_count() < devices:
        pytest.skip(f"needs {devices} GPUs")
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = tiny_model("qwen_image")
    cases = [Case("odd", "a red fox in the snow", negative="blurry",
                  params=dict(height=48, width=48, num_inference_steps=8, seed=1)),
             Case("bands", "two apples", params=dict(height=256, width=128, num_inference_steps=4, seed=2))]
    # TeaCache in float32 only: in bfloat16 a distance near the threshold may decide differently.
    tea = {"cache_backend": "tea_cache"} if dtype == "float32" else {}
    one = run_engine(_engine(folder, 1, dtype, **tea), cases)
    engine = _engine(folder, devices, dtype, **tea, **parallel)
    try:
        many = run_engine(engine, cases)
    finally:
        engine.group.close()
    for case in cases:
        torch.testing.assert_close(image_of(many[case.request_id]), image_of(one[case.request_id]),
                                   atol=IMAGE_ATOL[dtype], rtol=0, msg=f"{name} {dtype} {case.request_id}")
