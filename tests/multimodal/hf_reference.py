"""transformers' Qwen2_5OmniProcessor as the reference, runnable without torchvision.

Its video processor needs torchvision, so a stub hands back pixel values computed by
`reference_patchify` (transformers' Qwen2VL video processor math, copied) and the processor
does the rest: chat-template placeholders, audio features, interleaving for use_audio_in_video.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers.processing_utils as processing_utils
from transformers import AutoTokenizer, Qwen2_5OmniProcessor, WhisperFeatureExtractor, video_processing_utils
from transformers.feature_extraction_utils import BatchFeature
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

# The processor type-checks its sub-processors against classes looked up on this module, and
# the video base class (VideoProcessorMixin in 5.23, BaseVideoProcessor in 5.17) is not
# exported there when torchvision is missing.
_VIDEO_BASE_NAME = processing_utils.MODALITY_TO_BASE_CLASS_MAPPING["video_processor"]
VideoProcessorBase = getattr(video_processing_utils, _VIDEO_BASE_NAME)
setattr(processing_utils.transformers_module, _VIDEO_BASE_NAME, VideoProcessorBase)

# transformers >= 5.2x: audio of a video passed with audio_from_video_indices; before: in order.
NEW_OMNI_API = hasattr(processing_utils, "OmniModalProcessorMixin")


class StubVideoProcessor(VideoProcessorBase):
    patch_size, temporal_patch_size, merge_size = 14, 2, 2
    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self):  # no super().__init__: the real one wants torchvision
        self.outputs: list[tuple[torch.Tensor, list[int]]] = []

    def __call__(self, videos=None, **kwargs):
        return BatchFeature(
            {
                "pixel_values_videos": torch.cat([values for values, _ in self.outputs]),
                "video_grid_thw": torch.tensor([grid for _, grid in self.outputs]),
            }
        )


def reference_patchify(frames: np.ndarray, mean, std, patch=14, temporal=2, merge=2):
    """transformers 5.23 Qwen2VLVideoProcessor._preprocess after resizing (fused rescale +
    normalize, patchify), for one video: [T, H, W, 3] uint8 -> (pixel values, grid)."""
    videos = torch.from_numpy(frames).permute(0, 3, 1, 2)[None].float()
    m = (torch.tensor(mean) * 255.0).view(1, 1, 3, 1, 1)
    s = (torch.tensor(std) * 255.0).view(1, 1, 3, 1, 1)
    videos = (videos - m) / s
    batch_size, num_frames, channel, resized_height, resized_width = videos.shape
    if pad := -num_frames % temporal:
        videos = torch.cat((videos, videos[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
        num_frames += pad
    grid_t = num_frames // temporal
    grid_h, grid_w = resized_height // patch, resized_width // patch
    patches = videos.view(
        batch_size, grid_t, temporal, channel, grid_h // merge, merge, patch, grid_w // merge, merge, patch
    )
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    flat = patches.reshape(batch_size, grid_t * grid_h * grid_w, channel * temporal * patch * patch)
    return flat[0], [grid_t, grid_h, grid_w]


def make_reference(model_dir: Path) -> Qwen2_5OmniProcessor:
    pre = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    feature_extractor = WhisperFeatureExtractor(
        feature_size=pre["feature_size"], sampling_rate=pre["sampling_rate"], hop_length=pre["hop_length"],
        chunk_length=pre["chunk_length"], n_fft=pre["n_fft"],
    )
    image_processor = Qwen2VLImageProcessorPil(min_pixels=pre["min_pixels"], max_pixels=pre["max_pixels"])
    return Qwen2_5OmniProcessor(
        image_processor=image_processor, video_processor=StubVideoProcessor(),
        feature_extractor=feature_extractor, tokenizer=tokenizer, chat_template=tokenizer.chat_template,
    )


def run_reference(proc, messages, images=(), audios=(), videos=(), use_audio_in_video=False):
    """`videos`: (frames, sample_fps, audio or None) per video, frames already sampled and
    resized by our loader (the reference pipeline resizes them in qwen-omni-utils). `audios`:
    standalone audio in prompt order; with use_audio_in_video the video tracks are slotted in
    at their videos' positions in the messages."""
    text = proc.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ip = proc.image_processor
    proc.video_processor.outputs = [reference_patchify(f, ip.image_mean, ip.image_std) for f, _, _ in videos]
    kwargs = {}
    if videos:
        kwargs["fps"] = videos[0][1]  # one fps per call: the tests use one video per prompt
        kwargs["videos"] = [f for f, _, _ in videos]
    audio_list, slots = list(audios), []
    if use_audio_in_video and videos:
        kinds = [p["type"] for m in messages if isinstance(m["content"], list) for p in m["content"]]
        standalone, video_i, audio_list = iter(audios), iter(range(len(videos))), []
        for kind in kinds:
            if kind == "audio":
                audio_list.append(next(standalone))
                slots.append(None)
            elif kind == "video":
                index = next(video_i)
                audio_list.append(videos[index][2])
                slots.append(index)
        if NEW_OMNI_API:
            kwargs.update(load_audio_from_video=True, audio_from_video_indices=slots)
        else:
            kwargs["use_audio_in_video"] = True
    if images:
        kwargs["images"] = list(images)
    if audio_list:
        kwargs["audio"] = audio_list
    return proc(text=text, return_tensors="pt", **kwargs)


def assert_same(ours, ref, atol=1e-5):
    """Ours (a ThinkerPrompt) equals the reference BatchFeature: ids, and every tensor; audio
    features compared on the unmasked frames (ours keep only those)."""
    assert ours.prompt_token_ids == ref["input_ids"][0].tolist()
    mm = ours.mm_inputs
    expected = {k for k in ref if k not in ("input_ids", "attention_mask")}
    assert set(mm) == expected, (set(mm), expected)
    for key in expected - {"input_features", "feature_attention_mask"}:
        got, want = mm[key], torch.as_tensor(ref[key])
        assert got.shape == want.shape, (key, got.shape, want.shape)
        torch.testing.assert_close(got.to(want.dtype), want, atol=atol, rtol=0, msg=key)
    if "input_features" in mm:
        lengths = mm["feature_attention_mask"].sum(-1)
        assert lengths.tolist() == ref["feature_attention_mask"].sum(-1).tolist()
        assert mm["feature_attention_mask"].dtype == ref["feature_attention_mask"].dtype
        for i, n in enumerate(lengths.tolist()):
            assert mm["feature_attention_mask"][i, :n].all()
            torch.testing.assert_close(
                mm["input_features"][i, :, :n], ref["input_features"][i, :, :n], atol=atol, rtol=0
            )


__all__ = ["NEW_OMNI_API", "assert_same", "make_reference", "reference_patchify", "run_reference"]
