"""A generated video ([frames, 3, H, W] floats in [0, 1]) as an MP4 file, with PyAV.

    write_mp4(out.request_output.outputs[0].multimodal_output["video"][0], "out.mp4", fps=16)

The codec is H.264 (libx264, which PyAV's wheels bundle) when PyAV's FFmpeg has it, else
MPEG-4 part 2 (FFmpeg's built-in `mpeg4`, which every build has). Pixels are rounded to 8 bits
as diffusers' `numpy_to_pil` does; the colour format is yuv420p (what players expect) for even
sizes, yuv444p otherwise.
"""
from __future__ import annotations

import functools
from fractions import Fraction
from pathlib import Path

import torch

DEFAULT_FPS = 16  # for a video whose model does not say (Wan2.2 A14B's rate)
H264_OPTIONS = {"crf": "18", "preset": "fast"}  # visually lossless, a few seconds for 81 frames of 832 x 480


@functools.cache
def mp4_codec() -> str:
    """"libx264" when PyAV's FFmpeg can encode H.264 with it, else "mpeg4"."""
    import av

    try:
        av.codec.Codec("libx264", "w")
    except (av.codec.codec.UnknownCodecError, ValueError):
        return "mpeg4"
    return "libx264"


def to_uint8_frames(video: torch.Tensor) -> torch.Tensor:
    """[frames, 3, H, W] floats in [0, 1] -> [frames, H, W, 3] uint8 (diffusers' rounding)."""
    return (video.detach().float().cpu().permute(0, 2, 3, 1) * 255).round().clamp(0, 255).to(torch.uint8)


def write_mp4(video: torch.Tensor, path: str | Path, fps: float) -> None:
    import av

    frames = to_uint8_frames(video).numpy()
    height, width = frames.shape[1:3]
    codec = mp4_codec()
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p" if width % 2 == 0 and height % 2 == 0 else "yuv444p"
        if codec == "libx264":
            stream.options = dict(H264_OPTIONS)
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():  # flush the encoder's delayed frames
            container.mux(packet)
