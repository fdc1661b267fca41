"""The interface between the AR engine (core/) and a model: every hook it calls, with defaults.

A plain LLM overrides nothing but the required methods (`forward`, `compute_logits`,
`get_input_embeddings`, `load_weights`) and the size attributes. A stage model of a pipeline
(a thinker with media, a talker fed by a thinker) declares what it does with the class
attributes below and overrides the hooks it needs. The engine reads the attributes and calls
the hooks; it never probes a model for a method.

Per request, the engine calls, in order:
  inputs = model.parse_request_inputs(additional_information)   # once, at add_request
  prompt = model.prompt_token_ids(prompt_token_ids, inputs)      # once, at add_request
  model.begin_step()                                # each step, before the calls below
  model.prefill_graphable(request)                  # a step with its prefill, with CUDA graphs
  model.request_positions(request, start, end)      # each step, if uses_mrope
  model.decode_positions(request, position)         #   (instead, in a step of single tokens)
  model.embed_request_spans([(request, start, end), ...], ids)  # each step, if embeds_requests
  model.on_tokens_sampled(requests, hidden, ids)    # each step that sampled, after sampling (ids on the device)
  model.request_outputs(request, finished)          # with each output the request makes
A request fed by a streaming edge (its input arrives while it runs) also gets
  model.available_positions(request)                # after parsing and after each chunk
  model.append_request_inputs(request, info, final) # for each chunk of input
`request.model_inputs` holds what `parse_request_inputs` returned (None: no inputs);
`request.model_state` is scratch space the model may fill once per request (it survives
preemption, because it depends only on the inputs).
"""
from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Protocol, Union

import torch
from torch import nn
from transformers import PretrainedConfig

from vllm_omni.sampling_params import SamplingParams


class Request(Protocol):
    """What a model may read of an engine request (core.request.Request), and its scratch space."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None  # the request's seeded RNG, if it has a seed
    input_complete: bool  # False while its input streams in
    model_inputs: Any  # what parse_request_inputs returned
    model_state: dict[str, Any]  # the model's own per-request scratch space

    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def output_token_ids(self) -> list[int]: ...


class _Last(enum.Enum):
    LAST = "last"

    def __repr__(self) -> str:
        return "LAST"


LAST = _Last.LAST
# Which hidden states a stage exports: transformers' `output_hidden_states` index (0 = input
# embeddings, i = output of layer i-1, L = final post-norm) or LAST (the final post-norm states).
HiddenStateKey = Union[int, _Last]


def hidden_state_name(key: HiddenStateKey) -> str:
    """The documented string key of spec 003 (`multimodal_output["24"]`, `["last"]`)."""
    return LAST.value if key is LAST else str(key)


class StageModel(nn.Module):
    """Base class of every model the AR engine runs (see the module docstring)."""

    # --- what the model does (read once by the runner) ---------------------------------
    uses_mrope: ClassVar[bool] = False  # request_positions gives [3, n] multimodal positions
    embeds_requests: ClassVar[bool] = False  # embed_request_span builds every input row
    supports_cuda_graphs: ClassVar[bool] = True  # decode steps may replay captured graphs
    # One request's prefill span may replay a captured graph too (core/prefill_graphs.py): the
    # forward must be a function of its input rows, positions and attention metadata alone
    # (`prefill_graphable` can refuse a request whose forward would take more).
    supports_prefill_graphs: ClassVar[bool] = True
    accepts_streamed_input: ClassVar[bool] = False  # append_request_inputs / available_positions
    # False: even as a latent stage it exports no hidden states (its consumers read its tokens or
    # request_outputs), so no step copies them off the device.
    exports_hidden_states: ClassVar[bool] = True
    # A talker whose code predictor samples groups 1..G-1 of each frame: its sampling settings
    # (a stage's subtalker_sampling_params) are set once, at load, by set_predictor_sampling.
    has_code_predictor: ClassVar[bool] = False
    # A talker: seconds of audio each output token becomes downstream (a codec frame). The
    # scheduler then orders its requests by playback deadline (core/scheduler.py).
    audio_seconds_per_token: ClassVar[float | None] = None

    # --- sizes (set by the subclass) -----------------------------------------------------
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    # Stop ids of a vocabulary that is not the tokenizer's (a talker's codec); empty: the
    # tokenizer's EOS and the checkpoint's generation config decide.
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def exported_hidden_states(cls, hf_config: PretrainedConfig) -> tuple[int, ...]:
        """Layers a latent stage exports besides LAST (always): its input embeddings by default,
        which spec 003's bridges read as key "0"."""
        return (0,)

    # --- required ------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, *,
                inputs_embeds: torch.Tensor | None = None,
                capture_layers: Iterable[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Packed tokens [T] (or input rows [T, H]) -> (final hidden [T, H], captured layers)."""
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        raise NotImplementedError

    def set_predictor_sampling(self, values: Mapping[str, Any]) -> None:
        """The code predictor's sampling (predictor_sampling.py keys), before any graph capture."""
        raise ValueError(f"{type(self).__name__} has no code predictor to take subtalker_sampling_params")

    # --- per-request hooks -----------------------------------------------------------------
    def parse_request_inputs(self, info: Mapping[str, Any]) -> Any:
        """The request's model inputs (a stage's `additional_information`) as a typed object,
        or None. Called once when the request is added; ValueError fails that request alone."""
        if info:
            raise ValueError(f"{type(self).__name__} takes no per-request inputs, got {sorted(info)}")
        return None

    def prompt_token_ids(self, prompt_token_ids: list[int], inputs: Any) -> list[int]:
        """The prompt ids the engine runs (a model may lay out its own prompt from its inputs)."""
        return prompt_token_ids

    def request_positions(self, request: Request, start: int, end: int) -> torch.Tensor:
        """[3, end - start] M-RoPE positions of tokens start..end-1 (only when uses_mrope)."""
        raise NotImplementedError(f"{type(self).__name__} declares uses_mrope but has no request_positions")

    def decode_positions(self, request: Request, position: int) -> tuple[int, int, int]:
        """The (t, h, w) M-RoPE positions of token `position` alone (a decode step, when
        uses_mrope). Override with something cheaper than request_positions: it runs for every
        request of every decode step. Float positions (fractional M-RoPE) keep the step eager."""
        return tuple(self.request_positions(request, position, position + 1)[:, 0].tolist())

    def prefill_graphable(self, request: Request) -> bool:
        """Whether this request's prefill may replay a prefill graph (when supports_prefill_graphs)."""
        return True

    def capture_graphs(self) -> None:
        """CUDA graphs of the model's own (beyond the runner's decode and prefill graphs), captured
        at load with them: on CUDA, unless enforce_eager."""

    def begin_step(self) -> None:
        """A step starts: per-step scratch of the previous one may go (a decode step replayed
        from a CUDA graph embeds its requests but never calls forward)."""

    def embed_request_span(self, request: Request, start: int, end: int, token_ids: torch.Tensor) -> torch.Tensor:
        """[end - start, H] input rows of tokens start..end-1 (only when embeds_requests)."""
        raise NotImplementedError(f"{type(self).__name__} declares embeds_requests but has no embed_request_span")

    def embed_request_spans(self, spans: list[tuple[Request, int, int]], token_ids: torch.Tensor) -> torch.Tensor:
        """[T, H] input rows of a step's spans (request, start, end), in order; `token_ids` [T] are
        their tokens (when embeds_requests). By default one `embed_request_span` each; a model
        overrides it to build a decode step's rows in a few batched kernels."""
        rows, offset = [], 0
        for request, start, end in spans:
            rows.append(self.embed_request_span(request, start, end, token_ids[offset : offset + end - start]))
            offset += end - start
        return torch.cat(rows)

    def on_tokens_sampled(self, requests: list[Request], hidden: torch.Tensor, token_ids: torch.Tensor) -> None:
        """After sampling, before the engine appends the tokens: hidden [B, H] produced the B
        sampled `token_ids` ([B] long, on the device: under async scheduling the host reads them
        a step later, so nothing here may wait for them; `request.num_output_tokens` is the new
        token's index)."""

    def request_outputs(self, request: Request, finished: bool) -> dict[str, torch.Tensor]:
        """Named CPU tensors a request returns besides its tokens (a talker's codec frames):
        the rows made since the previous call; `finished`: this is its last output."""
        return {}

    # --- streamed input (a downstream stage of a streaming edge) ------------------------------
    def append_request_inputs(self, request: Request, info: Mapping[str, Any], final: bool) -> None:
        """Rows of input that streamed in for a started request; `final`: nothing more comes.
        ValueError fails that request alone."""
        raise ValueError(f"{type(self).__name__} does not take streamed input")

    def available_positions(self, request: Request) -> int | None:
        """How many positions of a request whose input is still streaming in have their inputs
        (the engine computes below that and waits for the rest); None: all of them."""
        return None
