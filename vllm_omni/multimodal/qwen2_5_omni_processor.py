"""Chat messages or a text prompt + media -> the Qwen2.5-Omni thinker's inputs.

    proc = Qwen2_5OmniInputProcessor.from_pretrained(model_dir)
    prompt = proc.process_messages(
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                      {"type": "text", "text": "What is this?"}]}])
    prompt.prompt_token_ids   # chat template applied, placeholders expanded
    prompt.mm_inputs          # input_features, pixel_values, image_grid_thw, ...

Same ids and tensors as transformers' Qwen2_5OmniProcessor (tests/multimodal compare them),
built from the three pieces that work without torchvision: the tokenizer, WhisperFeatureExtractor
and Qwen2VLImageProcessorPil; videos are decoded and patchified here (video.py, vision.py).
One difference: `input_features` keep only the unmasked frames (see whisper_features).

Requests may be processed from several threads at once: only the tokenizer (not safe to share
between threads) is used under a lock; media are read, decoded and turned into features
outside it, so a slow or large item holds up nothing but its own request.
"""

from __future__ import annotations

import inspect
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_omni.multimodal import qwen2_5_omni_placeholders as ph
from vllm_omni.multimodal.chat_parts import MediaItem, items_from_multi_modal_data, parse_messages, render_chat
from vllm_omni.multimodal.chat_template import QWEN2_5_OMNI_CHAT_TEMPLATE
from vllm_omni.multimodal.media import TRUSTED, MediaError, MediaPolicy, load_audio, load_image
from vllm_omni.multimodal.video import load_video
from vllm_omni.multimodal.vision import VideoSampling, patchify_video

# Image processor settings read from preprocessor_config.json (the rest of that file is the
# feature extractor's, or informational).
_IMAGE_KEYS = ("min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size",
               "image_mean", "image_std")


@dataclass
class ThinkerPrompt:
    """What the thinker stage needs for one request."""

    prompt_token_ids: list[int]
    # input_features [N_audio, 128, T] f32 + feature_attention_mask [N_audio, T] i32;
    # pixel_values [N_patches, 1176] f32 + image_grid_thw [N_image, 3] i64;
    # pixel_values_videos + video_grid_thw [N_video, 3] + video_second_per_grid [N_video] f32.
    # Only the modalities present; items in prompt order (for audio: the order of the audio
    # tokens, which with use_audio_in_video includes each video's track at its position).
    mm_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    use_audio_in_video: bool = False


class Qwen2_5OmniInputProcessor:
    def __init__(
        self,
        tokenizer,
        feature_extractor,
        image_processor,
        chat_template: str | None = None,
        video_sampling: VideoSampling | None = None,
        media: MediaPolicy = TRUSTED,
        position_id_per_seconds: float = 25,
        seconds_per_chunk: float = 2.0,
    ):
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self.image_processor = image_processor
        self.chat_template = chat_template or tokenizer.chat_template or QWEN2_5_OMNI_CHAT_TEMPLATE
        self.video_sampling = video_sampling or VideoSampling(
            frame_factor=image_processor.temporal_patch_size,
            image_factor=image_processor.patch_size * image_processor.merge_size,
        )
        self.media = media
        self.text_lock = threading.Lock()  # the tokenizer (and the chat template through it)
        self.position_id_per_seconds = position_id_per_seconds
        self.seconds_per_chunk = seconds_per_chunk
        self.ids = ph.OmniTokenIds.from_tokenizer(tokenizer)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, tokenizer=None, **kwargs) -> "Qwen2_5OmniInputProcessor":
        """From a checkpoint folder: tokenizer files, preprocessor_config.json, the chat
        template (chat_template.json / .jinja, else the tokenizer's) and config.json's thinker
        timing (position_id_per_seconds, seconds_per_chunk). kwargs go to __init__."""
        from transformers import AutoTokenizer, WhisperFeatureExtractor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        model_dir = Path(model_dir)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
        pre = json.loads((model_dir / "preprocessor_config.json").read_text())
        feature_extractor = WhisperFeatureExtractor(
            **{k: v for k, v in pre.items() if k in inspect.signature(WhisperFeatureExtractor).parameters}
        )
        image_processor = Qwen2VLImageProcessorPil(**{k: pre[k] for k in _IMAGE_KEYS if k in pre})
        kwargs.setdefault("chat_template", _folder_chat_template(model_dir))
        thinker = _thinker_config(model_dir)
        for key in ("position_id_per_seconds", "seconds_per_chunk"):
            if key in thinker:
                kwargs.setdefault(key, thinker[key])
        return cls(tokenizer, feature_extractor, image_processor, **kwargs)

    # ------------------------------------------------------------------ entry points

    def process_messages(
        self,
        messages: list[dict[str, Any]],
        use_audio_in_video: bool = False,
        add_generation_prompt: bool = True,
        video_options: dict[str, Any] | None = None,
        chat_template: str | None = None,
        **chat_template_kwargs: Any,
    ) -> ThinkerPrompt:
        """Chat messages (see chat_parts.py for the content parts) -> ThinkerPrompt.

        `video_options`: VideoSampling overrides for every video of the request (a video part's
        own options win). `chat_template` replaces the model's for this call, `chat_template_kwargs`
        are extra template variables. Raises ValueError (MediaError) for bad input."""
        rendered, items = parse_messages(messages)
        with self.text_lock:
            text = render_chat(self.tokenizer, rendered, chat_template or self.chat_template, add_generation_prompt,
                               chat_template_kwargs)
            ids = self._encode(text)
        return self._finish(ids, items, use_audio_in_video, video_options)

    def process_prompt(
        self,
        prompt: str | list[int],
        multi_modal_data: dict[str, Any] | None = None,
        use_audio_in_video: bool = False,
        video_options: dict[str, Any] | None = None,
    ) -> ThinkerPrompt:
        """A prompt already in template form (text or ids) with one placeholder per item
        (<|audio_bos|><|AUDIO|><|audio_eos|>, <|vision_bos|><|IMAGE|><|vision_eos|>, ...) and
        vLLM-style multi_modal_data {"image": ..., "audio": ..., "video": ...}."""
        if isinstance(prompt, str):
            with self.text_lock:
                ids = self._encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        items = items_from_multi_modal_data(multi_modal_data)
        return self._finish(ids, items, use_audio_in_video, video_options)

    # ------------------------------------------------------------------ internals

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def _finish(self, prompt_ids, items: list[MediaItem], use_audio_in_video, video_options) -> ThinkerPrompt:
        by_kind = {k: [it for it in items if it.kind == k] for k in ("image", "audio", "video")}
        for kind, found in ph.count_placeholders(prompt_ids, self.ids).items():
            if found != len(by_kind[kind]):
                raise MediaError(
                    f"the prompt has {found} {kind} placeholder(s) but {len(by_kind[kind])} {kind} item(s)"
                )
        use_audio_in_video = bool(use_audio_in_video and by_kind["video"])
        mm: dict[str, torch.Tensor] = {}

        image_lengths = self._images(by_kind["image"], mm)
        videos = [self._load_video(it, use_audio_in_video, video_options) for it in by_kind["video"]]
        standalone = [load_audio(it.source, self.media) for it in by_kind["audio"]]
        # Audio features go in the order of the audio tokens in the prompt: a standalone audio
        # at its <|AUDIO|>, a video's track at its <|VIDEO|> (use_audio_in_video). True = track.
        from_video = [
            t == self.ids.video
            for t in prompt_ids
            if t == self.ids.audio or (use_audio_in_video and t == self.ids.video)
        ]
        it_audio, it_video = iter(standalone), iter(videos)
        waves = [next(it_video).audio if v else next(it_audio) for v in from_video]
        audio_tokens = self._audio(waves, mm)
        track_tokens = [n for n, v in zip(audio_tokens, from_video) if v]
        video_expansions = self._videos(videos, track_tokens if use_audio_in_video else None, mm)
        standalone_tokens = [n for n, v in zip(audio_tokens, from_video) if not v]
        ids = ph.expand(prompt_ids, self.ids, image_lengths, standalone_tokens, video_expansions)
        return ThinkerPrompt(ids, mm, use_audio_in_video)

    def _audio(self, waves: list[np.ndarray], mm: dict[str, torch.Tensor]) -> list[int]:
        """Whisper features of `waves` into mm; -> audio tokens per wave."""
        if not waves:
            return []
        feats, mask = ph.whisper_features(self.feature_extractor, waves)
        mm["input_features"], mm["feature_attention_mask"] = feats, mask
        tokens = [ph.audio_tokens_for_frames(int(n)) for n in mask.sum(-1)]
        if min(tokens) <= 0:  # the encoder would get an empty sequence
            raise MediaError("an audio is too short (under 0.02 s)")
        return tokens

    def _images(self, items: list[MediaItem], mm: dict[str, torch.Tensor]) -> list[int]:
        if not items:
            return []
        pixels, grids = [], []
        for item in items:
            kwargs = {}
            if item.options:  # per-image pixel bounds, as transformers' size dict
                size = self.image_processor.size  # a SizeDict in transformers 5
                kwargs["size"] = {
                    "shortest_edge": self._pixel_bound(item.options, "min_pixels", size["shortest_edge"]),
                    "longest_edge": self._pixel_bound(item.options, "max_pixels", size["longest_edge"]),
                }
            image = load_image(item.source, self.media)
            try:
                out = self.image_processor(images=[image], return_tensors="np", **kwargs)
            except ValueError as e:  # e.g. an extreme aspect ratio
                raise MediaError(f"cannot process image: {e}") from None
            pixels.append(torch.from_numpy(np.asarray(out["pixel_values"], dtype=np.float32)))
            grids.append([int(x) for x in out["image_grid_thw"][0]])
        mm["pixel_values"] = torch.cat(pixels)
        mm["image_grid_thw"] = torch.tensor(grids, dtype=torch.int64)
        merge = self.image_processor.merge_size
        return [t * h * w // merge**2 for t, h, w in grids]

    def _pixel_bound(self, options: dict[str, Any], name: str, default: int) -> int:
        """A request's min_pixels / max_pixels: what an image may be resized to, within the limit."""
        value = int(options.get(name, default))
        if value > self.media.limits.max_image_pixels:
            raise MediaError(f"{name}={value} is over the {self.media.limits.max_image_pixels} pixel limit "
                             "(--max-image-pixels)")
        return value

    def _load_video(self, item: MediaItem, with_audio: bool, video_options):
        sampling = self.video_sampling.updated(video_options).updated(item.options)
        for name in ("min_pixels", "max_pixels"):
            self._pixel_bound({name: getattr(sampling, name)}, name, 0)
        clip = load_video(item.source, self.media, sampling, with_audio=with_audio)
        if with_audio and clip.audio is None:
            # The thinker's position ids assume every video has its audio interleaved.
            raise MediaError("use_audio_in_video is set but a video has no audio track")
        return clip

    def _videos(self, clips, track_tokens: list[int] | None, mm) -> list[list[int]]:
        """Patchify into mm; -> each <|VIDEO|>'s expansion (interleaved with its audio track's
        `track_tokens` tokens when given, i.e. use_audio_in_video)."""
        if not clips:
            return []
        ip = self.image_processor
        pixels, grids, seconds = [], [], []
        for clip in clips:
            values, grid = patchify_video(
                clip.frames, ip.image_mean, ip.image_std, ip.patch_size, ip.temporal_patch_size, ip.merge_size
            )
            pixels.append(values)
            grids.append(grid)
            seconds.append(ip.temporal_patch_size / clip.sample_fps)  # time covered by one grid_t
        mm["pixel_values_videos"] = torch.cat(pixels)
        mm["video_grid_thw"] = torch.tensor(grids, dtype=torch.int64)
        mm["video_second_per_grid"] = torch.tensor(seconds, dtype=torch.float32)
        if track_tokens is None:
            return [[self.ids.video] * (t * h * w // ip.merge_size**2) for t, h, w in grids]
        return [
            ph.video_with_audio_ids(
                self.ids, grid, ip.merge_size, sec, n_audio,
                self.position_id_per_seconds, self.seconds_per_chunk,
            )
            for grid, sec, n_audio in zip(grids, seconds, track_tokens)
        ]


def _folder_chat_template(model_dir: Path) -> str | None:
    # The processor's template (chat_template.json / .jinja) is the multimodal one; a
    # tokenizer_config.json template may be a text-only ChatML.
    jinja, js = model_dir / "chat_template.jinja", model_dir / "chat_template.json"
    if js.is_file():
        return json.loads(js.read_text())["chat_template"]
    if jinja.is_file():
        return jinja.read_text()
    return None


def _thinker_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return config.get("thinker_config", config)
