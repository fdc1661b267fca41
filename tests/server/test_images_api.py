"""/v1/images/generations on a real `vllm-omni serve` of the tiny Qwen-Image (its stage a thread of
the server), with the `openai` client.

Images are checked against diffusers' own QwenImagePipeline run in this process (8-bit PNGs:
equal up to one level where a float pixel sits on a rounding edge)."""
from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from tests.conftest import in_threads
from tests.pipeline.conftest import wait_until
from tests.server.conftest import ServerProcess

NAME = "tiny-qwen-image"
MAX_PIXELS = 96 * 96


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen_image")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("images-server")
    # Layerwise offload and the pipeline profiler change no image (the tests at the end check the profiler).
    srv = ServerProcess.launch([str(model_dir), "--served-model-name", NAME, "--max-generated-image-size",
                                str(MAX_PIXELS), "--default-sampling-params", '{"0": {"num_inference_steps": 2}}',
                                "--enable-layerwise-offload", "--enable-diffusion-pipeline-profiler",
                                "--stage-overrides", json.dumps(in_threads(1))],
                               tmp / "stdout.log")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(model_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)

    def run(prompt: str, width: int, height: int, seed: int, negative: str | None = None, n: int = 1,
            steps: int = 2) -> list[np.ndarray]:
        with torch.no_grad():
            images = pipe(prompt, negative_prompt=negative, height=height, width=width, num_inference_steps=steps,
                          num_images_per_prompt=n, generator=torch.Generator().manual_seed(seed), output_type="np")
        return [(img * 255).round().astype(np.int16) for img in images.images]  # diffusers' numpy_to_pil rounding
    return run


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def _assert_same(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1


def test_generate_with_the_openai_client(client, server, reference):
    before = server.metric("vllm_omni:stage_diffusion_steps_done", stage="0")
    result = client.images.generate(model=NAME, prompt="a red fox in the snow", size="48x32", n=2,
                                    response_format="b64_json",
                                    extra_body={"negative_prompt": "blurry", "num_inference_steps": 3, "seed": 3,
                                                "true_cfg_scale": 4.0})
    expected = reference("a red fox in the snow", 48, 32, seed=3, negative="blurry", n=2, steps=3)
    assert len(result.data) == 2
    for item, exp in zip(result.data, expected):
        _assert_same(_pixels(item.b64_json), exp)
    assert server.metric("vllm_omni:stage_diffusion_steps_done", stage="0") == before + 3  # one request, 3 steps
    jpeg = client.images.generate(model=NAME, prompt="a cat", size="32x32", output_format="jpeg",
                                  extra_body={"seed": 1})
    assert Image.open(io.BytesIO(base64.b64decode(jpeg.data[0].b64_json))).format == "JPEG"
    assert server.metric("vllm_omni:requests_total", endpoint="/v1/images/generations", status="200") >= 2


def test_concurrent_requests_of_different_sizes_each_equal_their_solo_runs(server, reference):
    jobs = [("a lighthouse", 32, 32, 1), ("two apples on a table", 48, 48, 2), ("a castle", 32, 32, 3),
            ("a boat", 64, 32, 4)]

    def post(job):
        prompt, width, height, seed = job
        r = server.post("/v1/images/generations", {"model": NAME, "prompt": prompt, "size": f"{width}x{height}",
                                                  "seed": seed}, timeout=300)
        assert r.status_code == 200, r.text
        return _pixels(r.json()["data"][0]["b64_json"])

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        images = list(pool.map(post, jobs))
    for (prompt, width, height, seed), got in zip(jobs, images):
        _assert_same(got, reference(prompt, width, height, seed)[0])


@pytest.mark.parametrize("change, param, match", [
    ({"size": "65x64"}, "size", "multiple of 16"),
    ({"size": "big"}, "size", "WIDTHxHEIGHT"),
    ({"size": "128x128"}, "size", "over this server's limit of 9216 pixels"),
    ({"num_inference_steps": 0}, "num_inference_steps", "num_inference_steps=0"),
    ({"num_inference_steps": 1}, None, "undefined schedule"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": 17}, "n", "num_outputs_per_prompt=17"),
    ({"seed": -1}, "seed", "non-negative"),
    ({"response_format": "url"}, "response_format", "b64_json"),
    ({"quality": "hd"}, "quality", "unsupported parameter"),
    ({"prompt": ""}, "prompt", "at least 1 character"),
])
def test_bad_requests_are_400(server, change, param, match):
    r = server.post("/v1/images/generations", {"model": NAME, "prompt": "x", "size": "32x32", **change})
    assert r.status_code == (500 if param is None else 400), r.text
    error = r.json()["error"]
    assert match in error["message"]
    if param is not None:
        assert error["param"] == param or param in (error["param"] or "")


def test_an_abandoned_request_is_aborted_between_steps(server):
    """A client that gives up mid-generation frees its batch slot: the stage stops denoising it."""
    steps_before = server.metric("vllm_omni:stage_diffusion_steps_done", stage="0")
    # Patience well under the time of 1000 tiny steps (3 s on an idle 2-core machine).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/images/generations", timeout=httpx.Timeout(30.0, read=1.0),
                   json={"model": NAME, "prompt": "a very long job", "size": "32x32",
                         "num_inference_steps": 1000})
    assert wait_until(lambda: server.metric("vllm_omni:stage_num_requests", stage="0") == 0, 30.0)
    stopped_at = server.metric("vllm_omni:stage_diffusion_steps_done", stage="0")
    assert steps_before <= stopped_at < steps_before + 1000  # aborted before the end (a loaded machine may not have begun)
    time.sleep(1.0)
    assert server.metric("vllm_omni:stage_diffusion_steps_done", stage="0") == stopped_at  # nothing runs any more
    r = server.post("/v1/images/generations", {"model": NAME, "prompt": "next", "size": "32x32"})
    assert r.status_code == 200 and len(r.json()["data"]) == 1


def test_a_text_to_image_model_refuses_an_edit(client):
    from tests.server.test_images_edit_api import png

    with pytest.raises(openai.BadRequestError, match="takes no input image"):
        client.images.edit(model=NAME, image=("in.png", png(16, 16), "image/png"), prompt="x", size="32x32")


PHASES = ("QwenImagePipeline.text_encoder.forward", "QwenImagePipeline.diffuse", "QwenImagePipeline.vae.decode")


def test_the_pipeline_profiler_reports_each_request_phases(client, server):
    counts = [server.metric("vllm_omni:request_stage_duration_seconds_count", phase=p) or 0 for p in PHASES]
    resp = client.images.generate(model=NAME, prompt="a red fox", size="32x32", extra_body={"seed": 3})
    durations = resp.model_extra["metrics"]["stage_durations"]
    assert set(durations) == set(PHASES) and all(d > 0 for d in durations.values())
    assert [server.metric("vllm_omni:request_stage_duration_seconds_count", phase=p) for p in PHASES] == [
        c + 1 for c in counts]


def test_sleep_routes_are_404_without_sleep_mode(server):
    assert httpx.get(f"{server.url}/is_sleeping", timeout=10).status_code == 404
    assert httpx.post(f"{server.url}/sleep", params={"level": 1}, timeout=10).status_code == 404
    assert httpx.post(f"{server.url}/wake_up", timeout=10).status_code == 404
