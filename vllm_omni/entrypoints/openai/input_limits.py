"""The serve flags that bound what one request may bring in (docs/operations.md, "Security:
inputs"), and the MediaPolicy they make.

    input_limits.add_arguments(parser)       # with the other serve flags
    policy = input_limits.media_policy(args)  # once, at start: bad values stop the server

The older media flags (--allowed-local-media-path, --media-fetch-timeout, --max-media-bytes,
--allowed-media-domains, --allow-private-media-urls) are in serve_args.py; this module adds the
per-request counts and the decode limits, every one with a default and a flag to raise it.
"""
from __future__ import annotations

import argparse

from vllm_omni.entrypoints.openai.realtime.limits import positive
from vllm_omni.multimodal.media_policy import MiB, DecodeLimits, MediaPolicy

DEFAULT_DIFFUSION_PROMPT_CHARS = 16384  # far past what a text encoder reads (Qwen-Image: 1024 tokens)
# Generated images: about 2 megapixels, the largest sizes Qwen-Image and OpenAI's image models
# offer (1328x1328, 1664x928, 1792x1024); --max-generated-image-size raises it.
DEFAULT_GENERATED_IMAGE_PIXELS = 2 * MiB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    policy, limits = MediaPolicy(), DecodeLimits()
    g = parser.add_argument_group("request inputs (media and prompts)")
    g.add_argument("--max-media-items", type=positive(int), default=policy.max_items,
                   help="media items (images, audio, videos, input_audio) one request may carry; more is 400")
    g.add_argument("--max-media-total-bytes", type=positive(int), default=policy.max_total_bytes,
                   help="bytes of all of one request's media together (fetched, read or inline); more is 400")
    g.add_argument("--max-audio-duration", type=positive(float), default=limits.max_audio_s,
                   help="seconds one audio (or a video's audio track) may decode to; decoding stops there: 400")
    g.add_argument("--max-image-pixels", type=positive(int), default=limits.max_image_pixels,
                   help="pixels of one image or video frame (read from its header before decoding), and the "
                        "largest size a request may ask an image to be resized to; more is 400")
    g.add_argument("--max-video-pixels", type=positive(int), default=limits.max_video_pixels,
                   help="pixels one video may decode to (frames x frame pixels, every frame at least 64x64); "
                        "decoding stops there: 400")
    g.add_argument("--max-diffusion-prompt-chars", type=positive(int), default=DEFAULT_DIFFUSION_PROMPT_CHARS,
                   help="characters of an image prompt or negative prompt, checked before tokenizing; more is 413")


def media_policy(args: argparse.Namespace, local_root) -> MediaPolicy:
    """The server's MediaPolicy; ValueError for a bad combination."""
    return MediaPolicy(allowed_local_root=local_root, timeout_s=args.media_fetch_timeout,
                       max_bytes=args.max_media_bytes, allowed_domains=tuple(args.allowed_media_domains or ()),
                       allow_private=args.allow_private_media_urls, max_items=args.max_media_items,
                       max_total_bytes=args.max_media_total_bytes,
                       limits=DecodeLimits(max_audio_s=args.max_audio_duration, max_image_pixels=args.max_image_pixels,
                                           max_video_pixels=args.max_video_pixels))
