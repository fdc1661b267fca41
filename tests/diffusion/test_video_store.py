"""The pieces of /v1/videos that need no server: the frame count of a request, a job's expiry,
the video store's size cap and its folder's lifetime."""
from __future__ import annotations

import pytest

from vllm_omni.entrypoints.openai.errors import APIError
from vllm_omni.entrypoints.openai.video_request import VideoJob, VideoRequest
from vllm_omni.entrypoints.openai.video_store import VideoStore, VideoStoreOptions


@pytest.mark.parametrize("body,fps,frames", [
    ({}, 16, 65),  # OpenAI's default 4 seconds at Wan2.2 A14B's 16 fps
    ({"seconds": "5"}, 16, 81),  # Wan2.2's usual 81 frames
    ({"seconds": 5}, 24, 121),  # TI2V-5B's 121
    ({"seconds": "0.01"}, 16, 5),  # at least one latent frame past the first
    ({"num_frames": 17}, 16, 17),
])
def test_frame_count(body, fps, frames):
    assert VideoRequest(prompt="x", **body).frame_count(fps, frame_step=4) == frames


def test_a_stage_default_frame_count_replaces_openais_four_seconds():
    assert VideoRequest(prompt="x").frame_count(16, 4, default_frames=81) == 81
    assert VideoRequest(prompt="x", seconds=1).frame_count(16, 4, default_frames=81) == 17


@pytest.mark.parametrize("body", [{"num_frames": 16}, {"num_frames": 17, "seconds": 1}])
def test_frame_count_refusals(body):
    with pytest.raises(APIError) as e:
        VideoRequest(prompt="x", **body).frame_count(16, frame_step=4)
    assert e.value.status == 400 and e.value.param == "num_frames"


def test_a_job_expires_its_ttl_after_completing():
    job = VideoJob("m", "p", "64x64", frames=5, fps=24)
    assert job.to_json()["status"] == "queued" and not job.expired(float("inf"))
    job.complete(ttl_s=60)
    assert job.expires_at - job.completed_at == 60
    assert not job.expired(job.completed_at + 59) and job.expired(job.completed_at + 60)
    assert job.to_json()["seconds"] == f"{5 / 24:g}"


def test_the_store_keeps_the_newest_videos_under_its_cap(tmp_path):
    store = VideoStore(VideoStoreOptions(folder=str(tmp_path), max_bytes=250))
    assert store.root.parent == tmp_path
    for name in ("a", "b", "c"):
        store.path(name).write_bytes(b"x" * 100)
    assert store.add("a") == [] and store.add("b") == []
    assert store.add("c") == ["a"] and not store.path("a").exists() and store.path("c").exists()
    store.path("big").write_bytes(b"x" * 300)
    with pytest.raises(ValueError, match="over the server's --video-store-max-bytes=250"):
        store.add("big")
    assert not store.path("big").exists()
    store.close()
    assert not store.root.exists() and tmp_path.exists()


def test_store_options_are_checked():
    with pytest.raises(ValueError, match="must be > 0"):
        VideoStoreOptions(ttl_s=0)
    with pytest.raises(ValueError, match="is not a directory"):
        VideoStoreOptions(folder="/nonexistent/videos")  # at startup, before any stage: serve says "error: ..."
