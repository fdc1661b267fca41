"""/v1/images/edits (multipart) on a real server of the tiny Qwen-Image-Edit (its stage a thread of
the server), with the `openai` client. The edit runs at the pipeline's real condition size (about 1024 x 1024 pixels), the
slowest request of the tiny models; its pixels are checked against diffusers in
tests/diffusion/test_qwen_image_edit_vs_diffusers.py."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import openai
import pytest
from PIL import Image

from tests.conftest import in_threads
from tests.server.conftest import ServerProcess

NAME = "tiny-edit"


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def edit_server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edit-server")
    srv = ServerProcess.launch([str(tiny_model("qwen_image_edit")), "--served-model-name", NAME,
                                "--stage-overrides", json.dumps(in_threads(1))],
                               tmp / "stdout.log").wait_ready()
    try:
        yield srv
    finally:
        srv.stop()


def test_edit_with_the_openai_client(edit_server):
    client = openai.OpenAI(base_url=f"{edit_server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    result = client.images.edit(model=NAME, image=("in.png", png(80, 48), "image/png"), prompt="make it snow",
                                size="48x32", extra_body={"num_inference_steps": 2, "seed": 1,
                                                          "negative_prompt": "blurry"})
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    assert image.size == (48, 32) and image.format == "PNG"
    pixels = np.asarray(image, dtype=np.int16)
    assert pixels.std() > 1  # an image, not a blank


@pytest.mark.parametrize("files, data, param, match", [
    ({}, {"prompt": "x"}, "image", "exactly one image file, got 0"),
    ({"image": ("a.png", b"not an image", "image/png")}, {"prompt": "x"}, "image", "cannot decode image"),
    ({"image[]": [("a.png", png(8, 8), "image/png"), ("b.png", png(8, 8), "image/png")]}, {"prompt": "x"},
     "image", "exactly one image file, got 2"),
    ({"image": ("a.png", png(8, 8), "image/png"), "mask": ("m.png", png(8, 8), "image/png")}, {"prompt": "x"},
     "mask", "masks are not supported"),
    ({"image": ("a.png", png(8, 8), "image/png")}, {"prompt": "x", "size": "17x16"}, "size", "multiple of 16"),
    ({"image": ("a.png", png(8, 8), "image/png")}, {"prompt": "x", "style": "vivid"}, "style",
     "unsupported parameter"),
])
def test_bad_edits_are_400(edit_server, files, data, param, match):
    import httpx

    items = [(k, f) for k, v in files.items() for f in (v if isinstance(v, list) else [v])]
    r = httpx.post(f"{edit_server.url}/v1/images/edits", files=items or None, data=data, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and match in r.json()["error"]["message"]


# ----------------------------------------------- limits (this server keeps every default)


def test_sizes_over_the_default_limit_are_400(edit_server):
    """No --max-generated-image-size: 2 megapixels at most, refused before the model sees it."""
    import httpx

    for size in ("2048x2048", "1000000x1000000"):
        r = httpx.post(f"{edit_server.url}/v1/images/edits", files=[("image", ("a.png", png(8, 8), "image/png"))],
                       data={"prompt": "x", "size": size}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text
        assert "--max-generated-image-size" in r.json()["error"]["message"]


def test_a_prompt_over_the_limit_is_413_before_it_is_tokenized(edit_server):
    import httpx

    long = "a fox " * 3000  # 18 000 characters (a form field is at most 1 MB anyway)
    r = httpx.post(f"{edit_server.url}/v1/images/edits", files=[("image", ("a.png", png(8, 8), "image/png"))],
                   data={"prompt": long}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["param"] == "prompt", r.text
    huge = "a fox " * 900_000  # 5.4 MB of JSON
    r = httpx.post(f"{edit_server.url}/v1/images/generations", json={"prompt": "x", "negative_prompt": huge},
                   timeout=60)
    assert r.status_code == 413 and "--max-diffusion-prompt-chars" in r.json()["error"]["message"], r.text


def test_an_edit_image_over_the_pixel_limit_is_refused_from_its_header(edit_server):
    import httpx

    from tests.multimodal.media_files import png_bomb

    bomb = png_bomb(6000, 6000)  # 100 kB that decode to 108 MB
    r = httpx.post(f"{edit_server.url}/v1/images/edits", files=[("image", ("a.png", bomb, "image/png"))],
                   data={"prompt": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "image", r.text
    assert "--max-image-pixels" in r.json()["error"]["message"]
