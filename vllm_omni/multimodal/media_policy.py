"""What a request may make the process read, and how much media it may decode.

    policy = MediaPolicy(allowed_local_root=Path("/srv/media"), max_items=8)   # a server's, from its flags
    TRUSTED                                                                    # the offline APIs' default

Every media source passes one gate (media_fetch.py): where it may come from (public http(s)
addresses unless `allow_private` or `allowed_domains` say more, url_guard.py; local files only
under `allowed_local_root`; data URLs whose MIME type matches the part's kind), how long a
download may take, and how many bytes one item and one request may bring. The decoders
(media.py, video.py) then stop at `DecodeLimits` while decoding: a few kilobytes of FLAC or
PNG can hold hours of audio or gigapixels, so nothing is decoded first and measured after.

A server's clients are untrusted: `MediaPolicy()` refuses local files and internal addresses.
`Omni` / `AsyncOmni` callers pass their own media, so `TRUSTED` reads any file and any address;
its decode limits are the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MiB = 1024 * 1024


class MediaError(ValueError):
    """Media that cannot be fetched or decoded (the client's fault: HTTP 400)."""


@dataclass(frozen=True)
class DecodeLimits:
    """How much one item may decode to (each flag raises its limit: docs/operations.md)."""

    max_audio_s: float = 600.0  # --max-audio-duration: seconds of one audio (or a video's track)
    # --max-image-pixels: one image or video frame as decoded, and the largest size a request may
    # ask an image or frame to be resized to (min_pixels / max_pixels options).
    max_image_pixels: int = 32 * MiB
    # --max-video-pixels: one video's frames as the decoder goes through them (frames x pixels),
    # and the frames it is sampled to (after resizing).
    max_video_pixels: int = 4096 * MiB
    max_audio_rate: int = 192_000  # Hz: above any real recording; bounds samples per second
    max_audio_s_flag: str = "--max-audio-duration"  # what an error over max_audio_s names (a caller's own cap)

    def __post_init__(self) -> None:
        for name in ("max_audio_s", "max_image_pixels", "max_video_pixels", "max_audio_rate"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_root: Path | None = None  # local files under this folder only; None: none at all
    timeout_s: float = 10.0  # --media-fetch-timeout: one whole download
    max_bytes: int = 64 * MiB  # --max-media-bytes: one item (download, file, data URL, upload)
    allowed_domains: tuple[str, ...] = ()  # non-empty: only these hosts (and subdomains) are fetched
    allow_private: bool = False  # let URLs reach loopback / private / link-local addresses
    max_items: int = 32  # --max-media-items: media items in one request
    max_total_bytes: int = 128 * MiB  # --max-media-total-bytes: all of one request's items together
    limits: DecodeLimits = field(default_factory=DecodeLimits)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "max_bytes", "max_items", "max_total_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"media policy: {name} must be > 0, got {getattr(self, name)}")


# The offline APIs: the caller's own program names its media, so any file and any address.
TRUSTED = MediaPolicy(allowed_local_root=Path("/"), allow_private=True, max_bytes=256 * MiB,
                      max_items=1024, max_total_bytes=4096 * MiB)


class MediaBudget:
    """One request's share of the policy: items and bytes are taken as they are fetched (a
    download counts while it arrives), so the request stops at the cap, not after it."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy
        self.items = 0
        self.bytes = 0

    def take_item(self) -> None:
        self.items += 1
        if self.items > self.policy.max_items:
            raise MediaError(f"the request holds more than {self.policy.max_items} media items, this server's "
                             "limit (--max-media-items)")

    def take_bytes(self, n: int) -> None:
        self.bytes += n
        if self.bytes > self.policy.max_total_bytes:
            raise MediaError(f"the request's media are over {self.policy.max_total_bytes} bytes together, this "
                             "server's limit (--max-media-total-bytes)")
