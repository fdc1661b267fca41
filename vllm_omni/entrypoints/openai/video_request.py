"""The body of POST /v1/videos and the video job object of OpenAI's Videos API.

    POST /v1/videos  {"prompt": "...", "model": "...", "size": "832x480", "seconds": "4",
                      "num_frames": 81, "num_inference_steps": 40, "seed": 7, "negative_prompt": "...",
                      "guidance_scale": 4.0, "guidance_scale_2": 3.0, "fps": 16}

as JSON, or as a multipart form (what the `openai` client sends) with `input_reference`: the
image to start from (image to video). OpenAI's fields: prompt, model, size ("WIDTHxHEIGHT"),
seconds, input_reference (a file, or {"image_url": ...}); the others are vLLM-Omni's.
"""
from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm_omni.entrypoints.openai.errors import APIError

_SIZE = re.compile(r"^(\d+)x(\d+)$")
DEFAULT_SECONDS = 4.0  # OpenAI's default clip length
MAX_FPS = 120.0
MAX_SECONDS = 600.0  # a bound for the arithmetic; the frame count's own bound (MAX_NUM_FRAMES) is lower
Status = Literal["queued", "in_progress", "completed", "failed"]


class VideoRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    model: str | None = None
    size: str | None = None  # None: the model's default size
    seconds: float | None = Field(None, gt=0, le=MAX_SECONDS)  # OpenAI sends a string ("4")
    input_reference: dict[str, str] | None = None  # JSON: {"image_url": "https://..." or a data URL}
    num_frames: int | None = None  # instead of seconds
    num_inference_steps: int | None = None
    seed: int | None = None
    negative_prompt: str | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    fps: float | None = Field(None, gt=0, le=MAX_FPS)  # the MP4's frame rate; None: the model's

    def dimensions(self) -> tuple[int, int] | None:
        """(width, height) of `size`, None when unset; 400 when malformed."""
        if self.size is None:
            return None
        match = _SIZE.match(self.size)
        if match is None:
            raise APIError(400, f"size {self.size!r} is invalid: use 'WIDTHxHEIGHT' (e.g. '832x480')", param="size")
        return int(match[1]), int(match[2])

    def frame_count(self, fps: float, frame_step: int, default_frames: int | None = None) -> int:
        """num_frames, else `seconds` at `fps` rounded to the model's frame_step k (k n + 1 frames),
        else the stage's default num_frames, else OpenAI's default 4 seconds."""
        if self.num_frames is not None:
            if self.seconds is not None:
                raise APIError(400, "give seconds or num_frames, not both", param="num_frames")
            if self.num_frames < 1 or (self.num_frames - 1) % frame_step:
                raise APIError(400, f"num_frames={self.num_frames} is invalid for this model: it makes "
                                    f"{frame_step}k + 1 frames (e.g. {4 * frame_step + 1})", param="num_frames")
            return self.num_frames
        if self.seconds is None and default_frames is not None:
            return default_frames
        seconds = DEFAULT_SECONDS if self.seconds is None else self.seconds
        return frame_step * max(1, round(seconds * fps / frame_step)) + 1

    def param_changes(self, frames: int) -> dict[str, Any]:
        """DiffusionSamplingParams fields this request sets."""
        changes: dict[str, Any] = {"num_frames": frames}
        size = self.dimensions()
        if size is not None:
            changes["width"], changes["height"] = size
        for name in ("num_inference_steps", "seed", "guidance_scale", "guidance_scale_2"):
            if getattr(self, name) is not None:
                changes[name] = getattr(self, name)
        return changes


@dataclass
class VideoJob:
    """One POST /v1/videos: its state as the Video object reports it."""

    model: str
    prompt: str
    size: str
    frames: int
    fps: float
    id: str = field(default_factory=lambda: f"video_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: Status = "queued"
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: dict[str, Any] | None = None

    @property
    def seconds(self) -> str:
        return f"{self.frames / self.fps:g}"

    def complete(self, ttl_s: float) -> None:
        now = time.time()
        self.status, self.progress = "completed", 100
        self.completed_at, self.expires_at = int(now), int(now + ttl_s)

    def fail(self, err: APIError) -> None:
        code = {400: "invalid_request", 413: "invalid_request", 503: "service_unavailable"}.get(err.status,
                                                                                              "generation_failed")
        self.status = "failed"
        self.completed_at = int(time.time())
        self.error = {"code": code, "message": err.message, "param": err.param}

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": self.expires_at, "size": self.size, "seconds": self.seconds, "prompt": self.prompt,
                "remixed_from_video_id": None, "error": self.error}
