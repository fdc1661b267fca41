"""--enable-diffusion-pipeline-profiler and --enable-layerwise-offload on a real `vllm-omni serve` of the
tiny Qwen-Image: each image response carries its prompt encoding, denoising and VAE decoding
seconds (and /metrics counts them); the offloaded blocks make the image diffusers makes. Without
--enable-sleep-mode the sleep routes do not exist."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from tests.server.conftest import ServerProcess

NAME = "tiny-qwen-image"
PHASES = ("QwenImagePipeline.text_encoder.forward", "QwenImagePipeline.diffuse", "QwenImagePipeline.vae.decode")


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen_image")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diffusion-profiler-server")
    srv = ServerProcess.launch([str(model_dir), "--served-model-name", NAME, "--enable-diffusion-pipeline-profiler",
                                "--enable-layerwise-offload", "--default-sampling-params",
                                '{"0": {"num_inference_steps": 2}}'], tmp / "stdout.log")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_image_responses_carry_the_pipeline_phases(server, model_dir):
    from diffusers import QwenImagePipeline

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    resp = client.images.generate(model=NAME, prompt="a red fox", size="32x32", extra_body={"seed": 3})
    durations = resp.model_extra["metrics"]["stage_durations"]
    assert set(durations) == set(PHASES) and all(d > 0 for d in durations.values())
    for phase in PHASES:
        assert server.metric("vllm_omni:request_stage_duration_seconds_count", phase=phase) == 1
    pipe = QwenImagePipeline.from_pretrained(model_dir)
    with torch.no_grad():
        want = pipe("a red fox", height=32, width=32, num_inference_steps=2, generator=torch.Generator().manual_seed(3),
                    output_type="np").images[0]
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json))), dtype=np.int16)
    assert np.abs(got - (want * 255).round().astype(np.int16)).max() <= 1  # 8-bit PNG rounding


def test_sleep_routes_are_404_without_sleep_mode(server):
    assert httpx.get(f"{server.url}/is_sleeping", timeout=10).status_code == 404
    assert httpx.post(f"{server.url}/sleep", params={"level": 1}, timeout=10).status_code == 404
    assert httpx.post(f"{server.url}/wake_up", timeout=10).status_code == 404
