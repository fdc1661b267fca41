"""A session's conversation: the items the model sees on every response (multi-turn history).

    conv.add(item, previous_item_id=None)   # after that item, or at the end
    conv.messages(instructions)             # -> chat messages for AsyncOmni.generate

User audio is kept as 16 kHz float32 samples and handed to the model as such; assistant
replies are kept as their text (the transcript of the speech), which is what the thinker reads
back on the next turn. A truncated reply keeps only the part of its transcript that was heard
(`truncate`). User images are kept as the bytes the media gate fetched when the item was
created (never fetched again). The history is bounded by `max_audio_s` of user audio,
`max_items` items and `max_text_chars` characters of text: the oldest items go first, as
OpenAI's `truncation: auto` drops the oldest items.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_omni.entrypoints.openai.realtime.audio import MODEL_RATE
from vllm_omni.entrypoints.openai.realtime.protocol import ProtocolError


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass(eq=False)  # identity: parts hold arrays, and an item is found by identity
class Part:
    type: str  # input_text | input_audio | input_image | output_text | output_audio
    text: str | None = None  # input_text, output_text
    transcript: str | None = None  # input_audio (given by the client), output_audio
    audio: np.ndarray | None = None  # input_audio: float32 at 16 kHz
    image_url: str | None = None  # input_image: the URL the client gave (echoed back)
    image: bytes | None = None  # input_image: what the media gate fetched from it
    audio_ms: int = 0  # output_audio: how much was generated
    heard_ms: int | None = None  # output_audio: where playback was cut (None: all of it)
    uncut_transcript: str | None = None  # output_audio: the whole transcript, once cut

    def wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type in ("input_text", "output_text"):
            out["text"] = self.text or ""
        elif self.type in ("input_audio", "output_audio"):
            out["transcript"] = self.transcript
        elif self.type == "input_image":
            out["image_url"] = self.image_url
        return out

    def spoken_text(self) -> str:
        return (self.text if self.type.endswith("_text") else self.transcript) or ""

    def text_chars(self) -> int:
        """Text this part holds (a cut transcript keeps its whole text too)."""
        return len(self.text or "") + len(self.transcript or "") + len(self.uncut_transcript or "")


@dataclass(eq=False)
class Item:
    role: str  # user | assistant | system
    content: list[Part]
    id: str = field(default_factory=lambda: new_id("item"))
    status: str = "completed"

    def wire(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "object": "realtime.item", "status": self.status,
                "role": self.role, "content": [p.wire() for p in self.content]}

    def audio_seconds(self) -> float:
        return sum(p.audio.size for p in self.content if p.audio is not None) / MODEL_RATE

    def text_chars(self) -> int:
        return sum(p.text_chars() for p in self.content)

    def images(self) -> list[bytes]:
        return [p.image for p in self.content if p.image is not None]

    def message(self) -> dict[str, Any] | None:
        """This item as a chat message for the model (None: nothing to say)."""
        if self.role != "user":
            text = "".join(p.spoken_text() for p in self.content)
            return {"role": self.role, "content": text} if text else None
        parts: list[Any] = []
        for p in self.content:
            if p.type == "input_text":
                parts.append({"type": "text", "text": p.text or ""})
            elif p.type == "input_audio" and p.audio is not None and p.audio.size:
                parts.append((p.audio, MODEL_RATE))  # chat_parts: a (waveform, rate) tuple is audio
            elif p.type == "input_image" and p.image is not None:
                parts.append({"type": "image_url", "image_url": {"url": p.image}})
        return {"role": "user", "content": parts} if parts else None


def cut_transcript(text: str, heard_ms: int, audio_ms: int) -> str:
    """The part of a reply's transcript that was heard when its audio stopped at `heard_ms`.

    The model gives no word timings, so the text is cut at the same fraction of its length as
    the audio, back to a word boundary. Nothing heard (no audio yet): nothing kept."""
    if heard_ms >= audio_ms > 0:
        return text
    if heard_ms <= 0:
        return ""
    keep = int(len(text) * heard_ms / audio_ms)
    if keep < len(text) and not text[keep:keep + 1].isspace():
        keep = text.rfind(" ", 0, keep) + 1
    return text[:keep].rstrip()


class Conversation:
    def __init__(self, max_audio_s: float, max_items: int, max_text_chars: int) -> None:
        self.items: list[Item] = []
        self.max_audio_s, self.max_items, self.max_text_chars = max_audio_s, max_items, max_text_chars
        self.id = new_id("conv")

    def get(self, item_id: str, param: str = "item_id") -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise ProtocolError(f"no item with id {item_id!r} in the conversation", code="item_not_found", param=param)

    def previous_id(self, item: Item) -> str | None:
        i = self.items.index(item)
        return self.items[i - 1].id if i > 0 else None

    def add(self, item: Item, previous_item_id: str | None = None) -> list[Item]:
        """Insert `item`; returns the items dropped to keep the bounds."""
        if any(i.id == item.id for i in self.items):
            raise ProtocolError(f"an item with id {item.id!r} already exists", code="duplicate_item_id", param="item.id")
        if previous_item_id is None:
            self.items.append(item)
        else:
            at = self.items.index(self.get(previous_item_id, "previous_item_id")) + 1
            self.items.insert(at, item)
        return self._bound(keep=item)

    def delete(self, item_id: str) -> None:
        self.items.remove(self.get(item_id))

    def _bound(self, keep: Item) -> list[Item]:
        dropped = []
        while True:
            oldest = self._oldest_over_bound()
            if oldest is None or oldest is keep:
                break  # a single item over a bound was refused before it got here
            self.items.remove(oldest)
            dropped.append(oldest)
        return dropped

    def _oldest_over_bound(self) -> Item | None:
        """The oldest item whose removal brings the conversation toward its bounds."""
        if len(self.items) > self.max_items:
            return next((i for i in self.items if i.status != "in_progress"), None)
        if sum(i.text_chars() for i in self.items) > self.max_text_chars:
            return next((i for i in self.items if i.text_chars() and i.status != "in_progress"), None)
        if sum(i.audio_seconds() for i in self.items) > self.max_audio_s:
            return next(i for i in self.items if i.audio_seconds() > 0)
        return None

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> Item:
        item = self.get(item_id)
        if item.role != "assistant":
            raise ProtocolError("only assistant messages can be truncated", param="item_id")
        if not 0 <= content_index < len(item.content) or item.content[content_index].type != "output_audio":
            raise ProtocolError(f"content {content_index} of item {item_id!r} is not audio", param="content_index")
        part = item.content[content_index]
        if audio_end_ms > part.audio_ms:
            raise ProtocolError(f"audio_end_ms {audio_end_ms} is past the item's {part.audio_ms} ms of audio",
                                param="audio_end_ms")
        self.cut(part, audio_end_ms)
        return item

    @staticmethod
    def cut(part: Part, heard_ms: int) -> None:
        if part.heard_ms is not None and part.heard_ms <= heard_ms:
            return  # already cut at or before this point
        if part.uncut_transcript is None:
            part.uncut_transcript = part.transcript or ""
        part.transcript = cut_transcript(part.uncut_transcript, heard_ms, part.audio_ms)
        part.heard_ms = heard_ms

    def messages(self, instructions: str) -> list[dict[str, Any]]:
        out = [{"role": "system", "content": instructions}] if instructions else []
        out += [m for m in (i.message() for i in self.items if i.status != "in_progress") if m is not None]
        return out
