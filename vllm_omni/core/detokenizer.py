"""Incremental detokenization and stop strings for one request (vLLM's semantics).

How text is produced, and why this way:

Decoding each new token on its own is wrong for byte-level BPE: a multi-byte character
(emoji, CJK) is often split over several tokens, and a token alone may decode to a
replacement character '\\ufffd'. Decoding the whole output each step is always right but
O(n^2) over a long output. We use vLLM's offset scheme, but with `tokenizer.decode` on a
small id window instead of `convert_tokens_to_string`, so it works for any tokenizer that
can decode ids (fast or slow, byte-level or sentencepiece):

    ids[prefix_offset:read_offset]  tokens already turned into text, kept only as context
    ids[read_offset:]               tokens whose text is not emitted yet

    new = decode(ids[prefix_offset:]) ; old = decode(ids[prefix_offset:read_offset])
    if new ends with '\\ufffd'  -> an incomplete UTF-8 sequence: emit nothing, wait for more ids
    else                       -> emit new[len(old):], and slide the window forward

The context tokens matter: decoders that strip a leading space from the first token
(sentencepiece's Metaspace, Strip) must see the token before, so the window starts in the
prompt (up to 5 tokens back, as vLLM does). Clean-up of tokenization spaces is turned off
because it rewrites text across the window boundary (" ." -> "."), which breaks the diff.
Each step decodes only a few tokens, so the whole output costs O(n).

Tokens held back because they end inside a character are not part of `output_text` until
the character completes; if generation ends there, that partial character is dropped (vLLM
does the same).
"""
from __future__ import annotations

from typing import Any

from vllm_omni.sampling_params import SamplingParams

# Prompt tokens decoded as context before the first output token (vLLM's value).
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""
        self.output_token_ids: list[int] = []
        self.finished = False  # a stop string ended generation
        self.stop: list[str] = list(params.stop or [])
        # Streaming must not emit text that a stop string found later would cut off: hold back
        # as many characters as the longest stop string could already have started. With
        # include_stop_str_in_output the cut is after the stop string, so nothing is held.
        if self.stop and not params.include_stop_str_in_output:
            self._stop_buffer = max(len(s) for s in self.stop) - 1
        else:
            self._stop_buffer = 0
        self._emitted = 0  # characters of output_text already returned by take_delta

        # Decode window over context + output ids (see module docstring).
        context = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    # ------------------------------------------------------------------ input

    def append(self, token_ids: list[int], *, stop_terminated: bool = False) -> str | None:
        """Add newly generated ids; update `output_text`; return the stop string that ended
        generation, else None.

        stop_terminated: the last id ended generation as EOS or a stop token id (decided by
        the stop checker). As in vLLM, its text is left out unless
        include_stop_str_in_output, and stop strings are not searched.
        """
        if self.finished:
            raise RuntimeError("append() after a stop string finished the request")
        self.output_token_ids.extend(token_ids)
        if not self.params.detokenize:
            return None

        to_decode = list(token_ids)
        if stop_terminated and to_decode and not self.params.include_stop_str_in_output:
            to_decode.pop()

        # Text produced while still under min_tokens cannot hold a stop string (vLLM).
        stop_check_offset = len(self.output_text)
        min_tokens = self.params.min_tokens
        first_index = len(self.output_token_ids) - len(token_ids)  # index of token_ids[0]
        for k, token_id in enumerate(to_decode):
            self.output_text += self._decode_next(token_id)
            if min_tokens and first_index + k + 1 <= min_tokens:
                stop_check_offset = len(self.output_text)

        if stop_terminated or not self.stop or len(self.output_token_ids) <= min_tokens:
            return None
        return self._check_stop_strings(len(self.output_text) - stop_check_offset)

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        ids = self._ids
        decode_kwargs = dict(
            skip_special_tokens=self.params.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        prefix_text = self.tokenizer.decode(ids[self._prefix_offset : self._read_offset], **decode_kwargs)
        new_text = self.tokenizer.decode(ids[self._prefix_offset :], **decode_kwargs)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing new (e.g. a skipped special token) or a character still incomplete:
            # keep the offsets so the next decode sees these bytes again.
            return ""
        # Slide the window: what was just emitted becomes the next step's context. Drop ids
        # before it so the buffer stays small.
        delta = new_text[len(prefix_text) :]
        del ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(ids)
        return delta

    def _check_stop_strings(self, new_char_count: int) -> str | None:
        """Find a stop string that ends in the new text (it may start in older text).

        The earliest match wins, so the output is cut at the first stop string whatever
        the order of the list.
        """
        if new_char_count <= 0:
            return None
        text = self.output_text
        best: tuple[int, str] | None = None
        for stop_str in self.stop:
            # Only matches that end inside the new text are new.
            start = max(0, len(text) - new_char_count - len(stop_str) + 1)
            index = text.find(stop_str, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop_str)
        if best is None:
            return None
        index, stop_str = best
        cut = index + len(stop_str) if self.params.include_stop_str_in_output else index
        self.output_text = text[:cut]
        self.finished = True
        return stop_str

    # ------------------------------------------------------------------ output

    def take_delta(self, final: bool = False) -> str:
        """Text added since the last call, for streaming.

        While generation goes on, the last max(len(stop))-1 characters are held back: they
        could be the start of a stop string that is not complete yet. Pass final=True when
        the request has finished for another reason (length, EOS, abort) to flush them;
        after a stop string has matched, everything left is flushed anyway.
        """
        end = len(self.output_text)
        if not (final or self.finished):
            end -= self._stop_buffer
        if end <= self._emitted:
            return ""
        delta = self.output_text[self._emitted : end]
        self._emitted = end
        return delta
