"""The talker's prompt rows for one TTS request, laid out as qwen-tts' `generate` does.

Rows (P of them) are sums of a text row (`text_projection(text_embedding(id))`) and a codec
row (`codec_embedding(id)`, a speaker embedding, or a reference frame's summed codes):

    [instructions: text rows of `<|im_start|>user\\n...<|im_end|>\\n`]          (if any)
    [role: text rows of `<|im_start|>assistant\\n`]
    [tts_pad x (C-2), tts_bos] + codec [think | nothink, think_bos, (language), think_eos,
                                        (speaker), codec_pad]
    then one of
      in-context cloning: text (ref transcript + text + tts_eos) against codec (codec_bos +
        reference frames): side by side when non-streaming, overlapped otherwise;
      non-streaming: text (all of it + tts_eos) + codec_pad each, then tts_pad + codec_bos;
      streaming: first text token + codec_bos.

The rest of the text (streaming) is the "trailing" stream: output token k's input row adds
trailing[k], then tts_pad once it is used up (text_feed.py). A request whose text streams in
(`text_complete` False) gets no tts_eos yet: it comes with the last chunk of text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vllm_omni.model_executor.models.qwen3_tts.tts_request import TTSRequest

# text ids -> [n, H] projected text rows; codec ids -> [n, H] codec rows
Embed = Callable[[list[int]], torch.Tensor]


@dataclass(frozen=True)
class CodecIds:
    pad: int
    bos: int
    think: int
    nothink: int
    think_bos: int
    think_eos: int

    @classmethod
    def from_config(cls, tc) -> CodecIds:
        return cls(tc.codec_pad_id, tc.codec_bos_id, tc.codec_think_id, tc.codec_nothink_id, tc.codec_think_bos_id,
                   tc.codec_think_eos_id)


def language_id(tc, request: TTSRequest) -> int | None:
    """qwen-tts: "auto" has no language row; a dialect speaker speaking Chinese (or auto) uses
    its dialect's row."""
    language = request.language.lower()
    lang = None if language == "auto" else tc.codec_language_id[language]
    dialect = tc.spk_is_dialect.get(request.speaker) if request.speaker else False
    if language in ("chinese", "auto") and dialect:
        lang = tc.codec_language_id[dialect]
    return lang


def _codec_prefix(ids: CodecIds, lang: int | None) -> list[int]:
    return [ids.nothink, ids.think_bos, ids.think_eos] if lang is None else [ids.think, ids.think_bos, lang,
                                                                           ids.think_eos]


def prompt_length(tc, request: TTSRequest, ref_frames: int) -> int:
    """P without computing a row (the engine needs it before the first step)."""
    n = (len(request.instruct_ids) if request.instruct_ids else 0) + 3
    has_speaker = request.speaker is not None or request.clones
    n += len(_codec_prefix(CodecIds.from_config(tc), language_id(tc, request))) + has_speaker + 1
    text = len(request.text_ids) - 8  # ids between the role and <|im_end|>\n<|im_start|>assistant\n
    if request.in_context:
        text_rows = len(request.ref_ids) - 5 + text + 1
        return n + (text_rows + ref_frames + 1 if request.non_streaming else ref_frames + 1)
    return n + (text + 2 if request.non_streaming else 1)


@dataclass
class TalkerPrompt:
    rows: torch.Tensor  # [P, H]
    trailing: torch.Tensor  # [T, H]
    pad: torch.Tensor  # [H] projected tts_pad
    eos: torch.Tensor  # [H] projected tts_eos
    text_read: int  # tokens of the text (not the reference's transcript) inside `rows`


def build_prompt(tc, special: tuple[int, int, int], request: TTSRequest, text: Embed, codec: Embed,
                 speaker: torch.Tensor | None, ref_rows: torch.Tensor | None) -> TalkerPrompt:
    """special: (tts_bos, tts_eos, tts_pad) text ids; speaker: [H] voice row or None;
    ref_rows: [F, H] summed reference frames (in-context cloning)."""
    ids = CodecIds.from_config(tc)
    bos, eos, pad = text(list(special)).unbind(0)
    codec_rows = codec(_codec_prefix(ids, language_id(tc, request)))
    if speaker is not None:
        codec_rows = torch.cat([codec_rows, speaker[None]])
    codec_rows = torch.cat([codec_rows, codec([ids.pad, ids.bos])])
    width = codec_rows.shape[0]
    parts = [text(request.instruct_ids)] if request.instruct_ids else []
    parts.append(text(request.text_ids[:3]))
    parts.append(torch.cat([pad.expand(width - 2, -1), bos[None]]) + codec_rows[:-1])
    body = request.text_ids[3:-5]
    end = [eos[None]] if request.text_complete else []
    trailing, read = pad[None][:0], len(body)
    if request.in_context:
        ref_body = request.ref_ids[3:-2]
        text_rows = torch.cat([text(ref_body + body), *end])
        frames = torch.cat([codec([ids.bos]), ref_rows])
        if request.non_streaming:
            parts += [text_rows + codec([ids.pad] * text_rows.shape[0]), frames + pad]
        elif text_rows.shape[0] > frames.shape[0]:
            parts.append(text_rows[: frames.shape[0]] + frames)
            trailing, read = text_rows[frames.shape[0]:], max(0, frames.shape[0] - len(ref_body))
        elif not request.text_complete:
            raise ValueError(f"streamed text must reach past the reference's {frames.shape[0]} frames before it "
                             f"starts (qwen-tts lays them side by side); it has {text_rows.shape[0]} tokens")
        else:
            filler = pad.expand(frames.shape[0] - text_rows.shape[0], -1)
            parts.append(torch.cat([text_rows, filler]) + frames)
    elif request.non_streaming:
        text_rows = torch.cat([text(body), eos[None]])
        parts += [text_rows + codec([ids.pad] * text_rows.shape[0]), (pad + codec([ids.bos])[0])[None]]
    else:
        parts.append(text(body[:1]) + codec_rows[-1:])
        trailing, read = torch.cat([text(body[1:]), *end]), 1
    return TalkerPrompt(rows=torch.cat(parts), trailing=trailing, pad=pad, eos=eos, text_read=read)


def min_streamed_text_tokens(ref_ids: list[int] | None, ref_frames: int) -> int:
    """Tokens of text a request whose text streams in needs before it can start: one, or with
    in-context cloning enough for the text (after the reference's transcript) to reach past the
    codec_bos and reference frames it is laid beside."""
    if ref_ids is None:
        return 1
    return max(1, ref_frames + 2 - len(ref_ids[3:-2]))
