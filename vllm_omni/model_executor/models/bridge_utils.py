"""What the Omni bridges (spec 003 stage input processors) share: reading the source stage's
outputs and the user's prompt (voice, multimodal layout)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from vllm_omni.growing_tensor import GrowingTensor
from vllm_omni.model_executor.device_copy import to_device_nowait
from vllm_omni.outputs import RequestOutput
from vllm_omni.stage_io import STREAM_UNITS_KEY, StageOutput

SPEAKER_KEY = "speaker"  # in the user's prompt additional_information: the voice to speak with
# The thinker's multimodal inputs (its request's model_inputs, as the prompt carries them) that
# decide M-RoPE positions: the talker lays its prompt out at the thinker's positions.
LAYOUT_TENSOR_KEYS = ("image_grid_thw", "video_grid_thw", "video_second_per_grid", "audio_feature_lengths")
USE_AUDIO_IN_VIDEO_KEY = "use_audio_in_video"


def requested_speaker(prompt: Any) -> str | None:
    """The voice a user asked for in the prompt's additional_information, if any."""
    if not isinstance(prompt, Mapping):
        return None
    info = prompt.get("additional_information") or {}
    return check_speaker(info.get(SPEAKER_KEY)) if isinstance(info, Mapping) else None


def multimodal_layout(prompt: Any) -> dict[str, Any]:
    """Grid sizes, audio lengths and timing of the thinker's media, from the processed prompt."""
    info = prompt.get("additional_information") if isinstance(prompt, Mapping) else None
    if not isinstance(info, Mapping):
        return {}
    layout = {name: info[name] for name in LAYOUT_TENSOR_KEYS if info.get(name) is not None}
    if "audio_feature_lengths" not in layout and info.get("feature_attention_mask") is not None:
        layout["audio_feature_lengths"] = info["feature_attention_mask"].sum(dim=1).long()
    if info.get(USE_AUDIO_IN_VIDEO_KEY):
        layout[USE_AUDIO_IN_VIDEO_KEY] = True
    return layout


def codes_without_stop_token(out: RequestOutput) -> list[int]:
    comp = out.outputs[0]
    codes = list(comp.token_ids)
    # A stop by token (EOS or stop_token_ids) appended that token; a stop string (not
    # meaningful for codec ids, but possible) did not.
    if comp.finish_reason == "stop" and not isinstance(comp.stop_reason, str) and codes:
        codes.pop()
    return codes


def finished_frames(out: RequestOutput, key: str) -> torch.Tensor:
    """A finished talker's codec frames [n, groups] under `key`, checked against its sampled
    tokens (group 0 of frame i is the i-th one). A stop token that ended the request has no frame
    (an EOS) or one code2wav must not speak (another stop id): the frames before it are kept."""
    outputs = out.outputs[0].multimodal_output
    frames = outputs.get(key)
    if not isinstance(frames, torch.Tensor) or frames.dim() != 2:
        raise ValueError(f"request {out.request_id}: talker output lacks {key!r} [frames, groups] "
                         f"(have {sorted(outputs)})")
    sampled = codes_without_stop_token(out)
    frames = frames[: len(sampled)]
    if frames[:, 0].tolist() != sampled:
        raise ValueError(f"request {out.request_id}: {key} ({frames.shape[0]} frames) do not match the "
                         f"talker's {len(sampled)} sampled tokens")
    if frames.shape[0] == 0:
        raise ValueError(f"request {out.request_id}: the talker produced no codec codes")
    return frames


def frames_so_far(talker: RequestOutput, key: str) -> torch.Tensor | None:
    """A streaming talker's codec frames [n, groups] under `key` so far (it never hands out a stop
    frame); None while there are none; ValueError if it finished without any."""
    frames = talker.outputs[0].multimodal_output.get(key)
    if frames is None or frames.shape[0] == 0:
        if talker.finished:
            raise ValueError(f"request {talker.request_id}: the talker produced no codec codes")
        return None
    return frames


def frames_chunk(delta: StageOutput, key: str) -> dict[str, torch.Tensor]:
    """The codec frames of one talker delta as a code2wav stream's units ({} when it made none)."""
    frames = delta.multimodal_output.get(key)
    return {STREAM_UNITS_KEY: frames} if frames is not None and frames.shape[0] else {}


def source_outputs(stage_list: list[Any], engine_input_source: list[int]) -> list[RequestOutput]:
    if len(engine_input_source) != 1:
        raise ValueError(f"expected exactly one source stage, got engine_input_source={engine_input_source}")
    outputs = list(stage_list[engine_input_source[0]].engine_outputs)
    ids = [o.request_id for o in outputs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"source stage outputs repeat request ids {ids}: refusing to mix requests")
    for o in outputs:
        if o.error is not None or not o.finished:
            state = f"failed: {o.error}" if o.error is not None else "is not finished"
            raise ValueError(f"request {o.request_id}: the source stage output {state}")
    return outputs


def rows_like(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A streamed chunk's rows on `like`'s device and dtype, without making the host wait (a
    talker takes a chunk per request per thinker step between its own steps)."""
    return to_device_nowait(rows, like.device).to(like.dtype)


def check_speaker(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{SPEAKER_KEY} must be a voice name (string), got {type(value).__name__}")
    return value


def streamed_rows(info: Mapping[str, Any], keys: Sequence[str], width: int) -> tuple[torch.Tensor, ...]:
    """The row tensors of one streamed input chunk, in `keys` order: exactly those keys, each
    [n, width], all with the same n. ValueError otherwise (the chunk fails its request)."""
    if set(info) != set(keys):
        raise ValueError(f"streamed input chunk has keys {sorted(info)}; expected {sorted(keys)}")
    rows = tuple(info[k] for k in keys)
    for key, t in zip(keys, rows):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != width:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"streamed input {key!r} must be [rows, {width}], got {shape}")
    if len({t.shape[0] for t in rows}) > 1:
        raise ValueError(f"streamed inputs {list(keys)} differ in rows: {[t.shape[0] for t in rows]}")
    return rows


class StreamedRowsQueue:
    """Streamed input rows waiting on the host until the talker's next step, when every
    request's go to the device in one upload and through one `transform` call.

    A talker gets a chunk per request per thinker step. Handled one by one (an upload and a few
    kernels each, between the talker's steps), 32 requests in flight kept the Qwen3-Omni talker
    from stepping for ~200 ms after their first rows arrived (H200 timeline, GPU round 10). The
    rows join their request's `GrowingTensor` in arrival order; `put_ready` rows (device rows,
    e.g. the end-of-text rows of a final chunk) keep their place after the rows queued before
    them. A request that finished meanwhile is dropped at the next flush.
    """

    def __init__(self) -> None:
        # id(request) -> (request, its sink, its items in order: a tuple of host rows, or device rows)
        self._queued: dict[int, tuple[Any, GrowingTensor, list[tuple[torch.Tensor, ...] | torch.Tensor]]] = {}

    def put(self, request: Any, sink: GrowingTensor, rows: tuple[torch.Tensor, ...]) -> None:
        """Host rows (one tensor per key, equal row counts) to be transformed, then appended."""
        self._queued.setdefault(id(request), (request, sink, []))[2].append(rows)

    def put_ready(self, request: Any, sink: GrowingTensor, rows: torch.Tensor) -> None:
        """Rows appended as they are, after the rows queued before them."""
        if id(request) in self._queued:
            self._queued[id(request)][2].append(rows)
        else:
            sink.append(rows)

    def num_rows(self, request: Any) -> int:
        """Rows queued for `request` (those still to be transformed and those ready)."""
        items = self._queued.get(id(request), (None, None, ()))[2]
        return sum((item[0] if isinstance(item, tuple) else item).shape[0] for item in items)

    def flush(self, like: torch.Tensor, transform: Callable[..., torch.Tensor]) -> None:
        """Every live request's queued rows into its sink: host rows concatenated per key,
        uploaded once (on `like`'s device and dtype), `transform(*keys)` -> [rows, H] once."""
        queued = [(sink, items) for request, sink, items in self._queued.values() if not request.status.finished]
        self._queued.clear()
        host = [item for _, items in queued for item in items if isinstance(item, tuple)]
        pieces = iter(())
        if host:
            keys = [rows_like(torch.cat(parts), like) for parts in zip(*host)]
            pieces = iter(transform(*keys).split([item[0].shape[0] for item in host]))
        for sink, items in queued:
            for item in items:
                sink.append(next(pieces) if isinstance(item, tuple) else item)
