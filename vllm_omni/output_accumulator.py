"""The one place where a request's output deltas accumulate (vLLM v1's output processor).

Engines emit deltas (`stage_io.StageOutput`: new token ids, new text, new logprobs, new tensor
rows), and stage engines and the transport pass them on unchanged. An `OutputAccumulator`
folds one request's deltas of one stage into its whole output and hands its reader what the
reader asked for (`outputs.RequestOutputKind`):

- FINAL_ONLY: nothing until the request finishes, then the whole output;
- CUMULATIVE: at every delta, a snapshot of the whole output so far (the reader may keep it
  while the request goes on);
- DELTA: at every delta, an output holding only that delta (nothing is copied).

Each comes with the delta it adds (`OmniRequestOutput.delta`: the whole output for FINAL_ONLY).
The orchestrator's request state keeps one per stage a request runs (bridges read the whole
outputs of upstream stages; `Omni`, `AsyncOmni` and the server read what it hands out), and
`LLM.generate` keeps one per request.
"""
from __future__ import annotations

import copy

import torch

from vllm_omni.growing_tensor import GrowingTensor
from vllm_omni.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from vllm_omni.stage_io import StageOutput


class OutputAccumulator:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> None:
        self.kind = kind
        # The whole output so far. Bridges read it; a streaming edge's downstream stage has its
        # prompt_token_ids set as its input streams in (engine/orchestrator.py).
        self.output = RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
                                    outputs=[CompletionOutput(index=0, text="", token_ids=[])], finished=False)
        # Tensor outputs that stream in as row chunks (hidden states, codec frames, audio).
        self._grown: dict[str, GrowingTensor] = {}

    def add(self, delta: StageOutput) -> tuple[RequestOutput, CompletionOutput] | None:
        """Fold one delta in. -> (what the reader gets now, the part of it that is new), or None
        while a FINAL_ONLY request runs."""
        self._fold(delta)
        out = self.output
        if self.kind is RequestOutputKind.FINAL_ONLY:
            return (out, out.outputs[0]) if out.finished else None
        new = CompletionOutput(index=0, text=delta.new_text, token_ids=delta.new_token_ids,
                               cumulative_logprob=delta.cumulative_logprob, logprobs=delta.new_logprobs,
                               finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                               multimodal_output=delta.multimodal_output)
        if self.kind is RequestOutputKind.DELTA:
            return RequestOutput(request_id=out.request_id, prompt=out.prompt, prompt_token_ids=out.prompt_token_ids,
                                 outputs=[new], finished=out.finished, error=out.error,
                                 num_cached_tokens=out.num_cached_tokens), new
        return (out if out.finished else self._snapshot()), new

    def _fold(self, delta: StageOutput) -> None:
        out = self.output
        comp = out.outputs[0]
        comp.token_ids.extend(delta.new_token_ids)
        comp.text += delta.new_text
        if delta.new_logprobs is not None:
            if comp.logprobs is None:
                comp.logprobs = []
            comp.logprobs.extend(delta.new_logprobs)
        comp.cumulative_logprob = delta.cumulative_logprob
        comp.finish_reason = delta.finish_reason
        comp.stop_reason = delta.stop_reason
        for key, tensor in delta.multimodal_output.items():
            comp.multimodal_output[key] = self._grow(key, tensor)
        out.finished = delta.finished
        out.error = delta.error
        out.num_cached_tokens = delta.num_cached_tokens

    def _grow(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """Tensor deltas are chunks along the first dimension; a 0-dim tensor is metadata (e.g.
        an audio sample rate) and replaces the previous value."""
        if tensor.dim() == 0:
            return tensor
        grown = self._grown.get(key)
        if grown is None:
            grown = self._grown[key] = GrowingTensor(tensor)
            return grown.view
        return grown.append(tensor)

    def _snapshot(self) -> RequestOutput:
        """The output as it is now, for a reader that keeps it while the request goes on (the
        lists and the dict keep changing here; tensor views and strings do not)."""
        out = copy.copy(self.output)
        comp = copy.copy(out.outputs[0])
        comp.token_ids = list(comp.token_ids)
        comp.logprobs = list(comp.logprobs) if comp.logprobs is not None else None
        comp.multimodal_output = dict(comp.multimodal_output)
        out.outputs = [comp]
        return out
