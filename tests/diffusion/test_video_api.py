"""/v1/videos on a real `vllm-omni serve` of the tiny Wan2.2 TI2V-5B (text or text + image to
video), with the `openai` client: create, poll, download (decoded with PyAV and compared with
diffusers' video through the same encoder), list, delete, and the errors (400, 404, 409)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest
from PIL import Image

from tests.conftest import in_threads
from tests.diffusion.conftest import MP4_SAME_VIDEO_LEVELS, WanCase, decode_mp4, mp4_levels_from, random_image
from tests.pipeline.conftest import wait_until
from tests.server.conftest import ServerProcess

# The openai client warns that OpenAI's own video service (Sora) will shut down; the API shape stays ours.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
NAME = "tiny-wan"
SIZE = dict(height=64, width=64)
EXTRA = {"num_frames": 5, "seed": 3}  # 2 steps: the server's default (--default-sampling-params)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("video-store")


@pytest.fixture(scope="module")
def server(wan_dir, store_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("video-server")
    # The diffusion stage runs as a thread of the server: nothing here is about stage processes.
    srv = ServerProcess.launch([str(wan_dir("ti2v")), "--served-model-name", NAME, "--video-store-dir",
                                str(store_dir), "--default-sampling-params", '{"0": {"num_inference_steps": 2}}',
                                "--stage-overrides", json.dumps(in_threads(1))], tmp / "stdout.log")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _finished(client, video_id: str, timeout_s: float = 180.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        video = client.videos.retrieve(video_id)
        if video.status in ("completed", "failed"):
            return video
        time.sleep(0.1)
    raise TimeoutError(f"video {video_id} not done within {timeout_s}s")


def _download(client, video_id: str, path: Path) -> Path:
    path.write_bytes(client.videos.download_content(video_id).content)
    return path


def test_create_poll_and_download_text_to_video(client, wan_pipes, tmp_path):
    video = client.videos.create(prompt="waves on a beach", model=NAME, size="64x64",
                                 extra_body={**EXTRA, "negative_prompt": "fog"})
    assert (video.object, video.model, video.size, video.prompt) == ("video", NAME, "64x64", "waves on a beach")
    assert video.status in ("queued", "in_progress", "completed") and video.created_at > 0
    done = _finished(client, video.id)
    assert done.status == "completed" and done.progress == 100 and done.error is None
    assert done.seconds == f"{5 / 24:g}" and done.expires_at > done.completed_at >= done.created_at
    path = _download(client, done.id, tmp_path / "ours.mp4")
    frames, rate = decode_mp4(path)
    assert frames.shape == (5, 64, 64, 3) and rate == 24  # TI2V-5B's frame rate
    case = WanCase("r", "waves on a beach", "fog", params={**SIZE, **EXTRA, "num_inference_steps": 2})
    assert mp4_levels_from(path, case.reference(wan_pipes("ti2v"))[0]) < MP4_SAME_VIDEO_LEVELS
    other_seed = WanCase("o", case.prompt, case.negative, params={**case.params, "seed": 4})
    assert mp4_levels_from(path, other_seed.reference(wan_pipes("ti2v"))[0]) > 2 * MP4_SAME_VIDEO_LEVELS


def test_image_to_video_from_an_uploaded_file(client, wan_pipes, tmp_path):
    image = random_image(48, 80, seed=7)
    upload = tmp_path / "first.png"
    Image.fromarray(image.numpy()).save(upload)
    video = client.videos.create(prompt="a boat sails away", model=NAME, size="64x64", input_reference=upload,
                                 extra_body={"num_frames": 5, "seed": 8, "guidance_scale": 3.0})
    done = _finished(client, video.id)
    assert done.status == "completed", done.error
    path = _download(client, done.id, tmp_path / "ours.mp4")
    case = WanCase("r", "a boat sails away", image=image,
                   params={**SIZE, "num_frames": 5, "seed": 8, "guidance_scale": 3.0, "num_inference_steps": 2})
    assert mp4_levels_from(path, case.reference(wan_pipes("ti2v"))[0]) < MP4_SAME_VIDEO_LEVELS


def test_seconds_give_the_frame_count_at_the_models_rate(server):
    r = server.post("/v1/videos", json={"prompt": "x", "size": "64x64", "seconds": "0.2", "seed": 1})
    assert r.status_code == 200, r.text
    assert r.json()["seconds"] == f"{5 / 24:g}"  # 0.2 s at 24 fps: 4.8 frames, rounded to 4k + 1 = 5


@pytest.mark.parametrize("body,param", [
    ({"size": "64x"}, "size"),
    ({"size": "48x48"}, "size"),  # TI2V-5B: multiples of 32
    ({"num_frames": 6}, "num_frames"),  # Wan: 4k + 1
    ({"num_frames": 5, "seconds": "4"}, "num_frames"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"fps": 0}, "fps"),
    ({"seconds": "inf"}, "seconds"),
    ({"seconds": 500}, "num_frames"),  # 8000 frames at 16 fps: over the frame bound
    ({"input_reference": {"file_id": "file-1"}}, "input_reference"),
    ({"frames_per_second": 3}, "frames_per_second"),
])
def test_bad_values_are_400(server, body, param):
    r = server.post("/v1/videos", json={"prompt": "x", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_bad_size_through_the_client_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="size"):
        client.videos.create(prompt="x", model=NAME, size="64x65", extra_body=EXTRA)
    with pytest.raises(openai.BadRequestError, match="cannot decode image"):
        client.videos.create(prompt="x", model=NAME, size="64x64", input_reference=("bad.png", b"not an image"),
                             extra_body=EXTRA)


def test_unknown_ids_are_404(client, server):
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_nope")
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content("video_nope")
    with pytest.raises(openai.NotFoundError):
        client.videos.delete("video_nope")
    assert server.post("/v1/videos", json={"prompt": "x", "model": "other"}).status_code == 404


def test_list_pages_and_delete_removes_the_file(client, store_dir):
    ids = [client.videos.create(prompt=f"clip {i}", model=NAME, size="64x64", extra_body=EXTRA).id for i in range(2)]
    for video_id in ids:
        assert _finished(client, video_id).status == "completed"
    newest_first = [v.id for v in client.videos.list(limit=100)]
    assert newest_first[:2] == ids[::-1]
    first = client.videos.list(order="asc", limit=1)
    assert len(first.data) == 1 and first.has_more and first.last_id == first.data[0].id
    following = client.videos.list(order="asc", limit=1, after=first.last_id)
    assert following.data[0].id != first.data[0].id
    files = {p.name for p in store_dir.rglob("*.mp4")}
    assert f"{ids[0]}.mp4" in files
    deleted = client.videos.delete(ids[0])
    assert (deleted.id, deleted.deleted, deleted.object) == (ids[0], True, "video.deleted")
    assert f"{ids[0]}.mp4" not in {p.name for p in store_dir.rglob("*.mp4")}
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(ids[0])


def test_a_running_job_has_no_content_and_deleting_it_aborts_it(client, server):
    video = client.videos.create(prompt="a long one", model=NAME, size="64x64",
                                 extra_body={**EXTRA, "num_inference_steps": 1000})
    assert wait_until(lambda: server.metric("vllm_omni:stage_num_requests", stage="0") == 1.0, 30.0)
    r = server.get(f"/v1/videos/{video.id}/content")
    assert r.status_code == 409 and "not completed" in r.json()["error"]["message"]
    client.videos.delete(video.id)
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    # Aborted between two steps, long before its 1000 (~10 ms each here): the stage is free.
    assert wait_until(lambda: server.metric("vllm_omni:stage_num_requests", stage="0") == 0.0, 5.0)
    assert _finished(client, client.videos.create(prompt="next", model=NAME, size="64x64", extra_body=EXTRA).id) \
        .status == "completed"


def test_shutdown_removes_the_store(server, store_dir):
    """Last in this module: the server stops, and its folder of finished videos goes with it."""
    assert any(store_dir.iterdir())
    server.stop()
    assert not any(store_dir.iterdir())
