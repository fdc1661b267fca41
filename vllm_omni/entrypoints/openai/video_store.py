"""Where finished videos of /v1/videos wait to be downloaded (`vllm-omni serve --video-*` flags).

Each server writes into a folder of its own, made under --video-store-dir (default: the
system's temporary folder) and removed when the server exits. A video is kept for
--video-ttl-s seconds after it completes (its `expires_at`), until it is deleted, or until the
folder would grow past --video-store-max-bytes: then the oldest videos go first (their jobs are
gone: 404). Expired videos are removed the next time the API is called.
"""
from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class VideoStoreOptions:
    folder: str | None = None  # None: the system's temporary folder
    ttl_s: float = 3600.0  # OpenAI keeps generated videos for a limited time too (expires_at)
    max_bytes: int = 4 * 1024 ** 3

    def __post_init__(self) -> None:
        if self.ttl_s <= 0 or self.max_bytes <= 0:
            raise ValueError(f"--video-ttl-s and --video-store-max-bytes must be > 0, got {self.ttl_s}, "
                             f"{self.max_bytes}")
        if self.folder is not None and not Path(self.folder).is_dir():  # refused at startup, before any stage
            raise ValueError(f"--video-store-dir {self.folder!r} is not a directory")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = VideoStoreOptions()
    g = parser.add_argument_group("video API (/v1/videos)")
    g.add_argument("--video-store-dir", default=d.folder,
                   help="folder under which the server keeps finished videos (in a folder of its own, removed "
                        "on exit); default: the system's temporary folder")
    g.add_argument("--video-ttl-s", type=float, default=d.ttl_s,
                   help="seconds a finished video stays downloadable")
    g.add_argument("--video-store-max-bytes", type=int, default=d.max_bytes,
                   help="bytes of finished videos kept at most; the oldest are removed first")


def from_args(args: argparse.Namespace) -> VideoStoreOptions:
    return VideoStoreOptions(args.video_store_dir, args.video_ttl_s, args.video_store_max_bytes)


class VideoStore:
    def __init__(self, options: VideoStoreOptions) -> None:
        self.options = options
        # A finalizer removes the folder at exit even when close() is never called.
        self._folder = tempfile.TemporaryDirectory(prefix="vllm-omni-videos-", dir=options.folder)
        self.root = Path(self._folder.name)
        self._sizes: dict[str, int] = {}  # video id -> bytes, oldest first

    def path(self, video_id: str) -> Path:
        return self.root / f"{video_id}.mp4"

    def add(self, video_id: str) -> list[str]:
        """Account for the file just written at path(video_id); returns the ids evicted to stay
        under the size cap (oldest first). ValueError: the video alone is over the cap."""
        size = self.path(video_id).stat().st_size
        if size > self.options.max_bytes:
            self.remove(video_id)
            raise ValueError(f"the video is {size} bytes, over the server's --video-store-max-bytes="
                             f"{self.options.max_bytes}")
        self._sizes[video_id] = size
        evicted = []
        while sum(self._sizes.values()) > self.options.max_bytes:
            oldest = next(iter(self._sizes))
            self.remove(oldest)
            evicted.append(oldest)
        return evicted

    def remove(self, video_id: str) -> None:
        self._sizes.pop(video_id, None)
        self.path(video_id).unlink(missing_ok=True)

    def close(self) -> None:
        self._sizes.clear()
        self._folder.cleanup()
