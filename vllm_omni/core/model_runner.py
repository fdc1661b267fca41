"""Runs one scheduled step on the device: inputs, forward, sampling, hidden states.

On CUDA, attention uses the Triton/FlashAttention backend and pure-decode steps replay
CUDA graphs (unless `enforce_eager`); on CPU everything runs eagerly on the portable
torch backend. Both paths compute the same function.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

import vllm_omni.envs as envs
from vllm_omni.core.request import Request
from vllm_omni.core.scheduler import ScheduledRequest, SchedulerOutput
from vllm_omni.model_executor.device_copy import HostCopy, to_device_nowait
from vllm_omni.model_executor.forward_context import AttentionMetadata, set_forward_context
from vllm_omni.model_executor.layers.attention import Attention, TorchAttentionBackend
from vllm_omni.model_executor.layers.sampler import PendingSample, Sampler, SamplerOutput, SamplingBatch
from vllm_omni.model_executor.models.stage_model import LAST, HiddenStateKey, StageModel

logger = logging.getLogger(__name__)


class PendingTokens:
    """A step's sampled tokens still on the device (async scheduling): `sample.tokens[i]` is the
    token of `requests[i]`. The next step reads its inputs from here; `result()` waits for the
    host copy of this step's tokens alone."""

    def __init__(self, requests: list[Request], sample: PendingSample) -> None:
        self.requests = requests
        self.sample = sample
        self._row = {r.request_id: i for i, r in enumerate(requests)}

    def value_of(self, request: Request) -> torch.Tensor:
        """[1] long on the device: the token this step sampled for `request`."""
        i = self._row[request.request_id]
        return self.sample.tokens[i : i + 1]

    def copy_into(self, ids: torch.Tensor, rows: list[int], requests: list[Request]) -> None:
        """ids[rows[j]] = the token sampled for requests[j], on the device."""
        src = [self._row[r.request_id] for r in requests]
        tokens = self.sample.tokens
        if rows == src == list(range(len(rows))):  # the steady state: same batch, same order
            ids[: len(rows)].copy_(tokens[: len(rows)])
            return
        device = ids.device
        ids.index_copy_(0, to_device_nowait(torch.tensor(rows), device),
                        tokens.index_select(0, to_device_nowait(torch.tensor(src), device)))

    def result(self) -> SamplerOutput:
        return self.sample.result()


class StepHiddenStates:
    """The hidden states a step exports: per request and key, the rows of the positions it
    computed. They travel to the host behind the step (one HostCopy per key), so reading them
    (`of`) waits for that copy alone; under async scheduling the engine reads them a step later."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[dict[HiddenStateKey, HostCopy], int, int]] = {}

    def add(self, tensors: dict[HiddenStateKey, torch.Tensor], spans: dict[str, tuple[int, int]]) -> None:
        """tensors: [T, H] per key; spans: request id -> (start, end) of its rows among the T."""
        rows = [r for start, end in spans.values() for r in range(start, end)]
        copies = {key: HostCopy(select_rows(t, rows)) for key, t in tensors.items()}
        offset = 0
        for request_id, (start, end) in spans.items():
            self._rows[request_id] = (copies, offset, offset + end - start)
            offset += end - start

    def of(self, request_id: str) -> dict[HiddenStateKey, torch.Tensor] | None:
        """The request's rows on the host (None: it exported none this step)."""
        entry = self._rows.get(request_id)
        if entry is None:
            return None
        copies, start, end = entry
        return {key: copy.get()[start:end] for key, copy in copies.items()}

    def update(self, other: StepHiddenStates) -> None:
        self._rows.update(other._rows)


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # The hidden states of the tokens computed this step, for the requests that export them.
    hidden_states: StepHiddenStates = field(default_factory=StepHiddenStates)
    # A deferred step (`execute(defer=True)`): its tokens, not read yet (`sampled` stays empty).
    pending: PendingTokens | None = None


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] or [3, T]
    inputs_embeds: torch.Tensor | None  # [T, H]
    meta: AttentionMetadata
    query_start: list[int]


def select_attention_backend(device: torch.device, dtype: torch.dtype):
    """Triton/FlashAttention on CUDA, the torch reference elsewhere (or when forced with
    VLLM_OMNI_ATTENTION_BACKEND=torch, e.g. to compare the two)."""
    if device.type == "cuda" and envs.ATTENTION_BACKEND.get() != "torch":
        from vllm_omni.model_executor.layers.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend(dtype)
    return TorchAttentionBackend()


def select_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] for increasing rows, as slices of their contiguous runs: no index tensor to copy
    to the device (a copy from pageable memory waits for the queued GPU work)."""
    if rows == list(range(t.shape[0])):
        return t
    runs: list[list[int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return t[runs[0][0]:runs[0][1]] if len(runs) == 1 else torch.cat([t[a:b] for a, b in runs])


class ARModelRunner:
    def __init__(
        self,
        model: StageModel,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int,
        max_num_seqs: int = 256,
        max_model_len: int = 4096,
        hidden_state_layers: tuple[int, ...] = (),
        enforce_eager: bool = False,
        samples: bool = True,
    ) -> None:
        self.model = model
        # False on tensor-parallel ranks other than 0: they run the same forward and join the
        # logits gather, rank 0 samples (core/tp_worker.py).
        self.samples = samples
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.hidden_state_layers = tuple(hidden_state_layers)
        self.sampler = Sampler()
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.backend = select_attention_backend(device, dtype)
        for layer in self.attention_layers:
            layer.backend = self.backend
        self._allocate_kv_cache()
        self.graphs = None
        self.prefill_graphs = None
        if device.type == "cuda" and not enforce_eager and not isinstance(self.backend, TorchAttentionBackend):
            self._capture_graphs(max_num_seqs, max_model_len)
            self.model.capture_graphs()

    def _allocate_kv_cache(self) -> None:
        # One block more than the block manager hands out: padded rows of a CUDA-graph
        # batch write their KV there.
        for layer in self.attention_layers:
            shape = (self.num_blocks + 1, self.block_size, layer.num_kv_heads, layer.head_dim)
            # Zeroed, not empty: masked-out keys are still multiplied by 0 in SDPA, and
            # uninitialised memory may hold NaN bit patterns.
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        if not self.model.supports_cuda_graphs or not self._moe_capturable():
            logger.info("%s does not support CUDA graphs here: decode runs eagerly", type(self.model).__name__)
            return
        from vllm_omni.core.cuda_graphs import DecodeGraphs
        from vllm_omni.core.prefill_graphs import PrefillGraphs

        self.graphs = DecodeGraphs(
            self.model,
            device=self.device,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            block_size=self.block_size,
            scratch_block=self.num_blocks,
            mrope=self.model.uses_mrope,
            embeds=self.model.embeds_requests,
            capture_layers=self.hidden_state_layers,
        )
        self.graphs.capture()
        if self.model.supports_prefill_graphs and self.backend.use_flash and envs.PREFILL_CUDA_GRAPHS.get():
            self.prefill_graphs = PrefillGraphs(
                self.model, device=self.device, max_tokens=max_model_len, block_size=self.block_size,
                scratch_block=self.num_blocks, mrope=self.model.uses_mrope, embeds=self.model.embeds_requests,
                capture_layers=self.hidden_state_layers)
            self.prefill_graphs.capture()

    def _moe_capturable(self) -> bool:
        """MoE layers avoid host syncs only on the grouped-GEMM path (Hopper, bf16)."""
        from vllm_omni.model_executor.layers.moe import FusedExperts, grouped_mm_available

        if not any(isinstance(m, FusedExperts) for m in self.model.modules()):
            return True
        return grouped_mm_available(torch.empty(1, dtype=self.dtype, device=self.device))

    def check_health(self) -> None:
        """Raises when the runner can run no more steps; one process has no rank to lose
        (the tensor-parallel executor's can die)."""

    @staticmethod
    def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return sum(
            2 * block_size * m.num_kv_heads * m.head_dim * element for m in model.modules() if isinstance(m, Attention)
        )

    # --- one step -----------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, previous: PendingTokens | None = None,
                defer: bool = False) -> RunnerOutput:
        """Run a step. `previous`: the step before, deferred: requests whose last token is still a
        placeholder take it from there. `defer`: leave this step's tokens on the device
        (`RunnerOutput.pending`), so the host can schedule and launch the next step first."""
        items = sched.scheduled
        self.model.begin_step()
        want_hidden = any(item.request.return_hidden_states for item in items)
        replayed = self._replay_graphs(items, previous) if self.graphs is not None else None
        if replayed is not None:
            items, query_start, hidden, captured, row_logits = replayed
        else:
            inputs = self._prepare(items, previous)
            query_start = inputs.query_start
            inputs.meta.backend_state = self.backend.prepare(inputs.meta)
            capture = self.hidden_state_layers if want_hidden else ()
            with set_forward_context(inputs.meta):
                hidden, captured = self.model(
                    inputs.input_ids, inputs.positions, inputs_embeds=inputs.inputs_embeds, capture_layers=capture
                )
            row_logits = None

        out = RunnerOutput()
        if want_hidden:
            self._slice_hidden_states(items, query_start, hidden, captured, out)
        sample_rows = [i for i, item in enumerate(items) if item.completes_sequence]
        if sample_rows:
            sampled_hidden = select_rows(hidden, [query_start[i + 1] - 1 for i in sample_rows])
            if row_logits is not None:  # graphs: the logits of every item's last row
                logits = select_rows(row_logits, sample_rows)
            else:
                logits = self.model.compute_logits(sampled_hidden)
            if not self.samples:
                return out
            reqs = [items[i].request for i in sample_rows]
            pending = self._sample(reqs, logits, previous)
            self.model.on_tokens_sampled(reqs, sampled_hidden, pending.tokens)
            if defer:
                out.pending = PendingTokens(reqs, pending)
                return out
            result = pending.result()
            for r, token, lp in zip(reqs, result.token_ids, result.logprobs):
                out.sampled[r.request_id] = token
                if lp is not None:
                    out.logprobs[r.request_id] = lp
        return out

    def _replay_graphs(self, items: list[ScheduledRequest], previous: PendingTokens | None):
        """The step through captured graphs: its decode rows through the decode graph, the prefill
        spans of up to `max_spans` requests packed through a prefill graph. Returns (items
        reordered: decode rows first, query_start, hidden, captured layers, logits of each item's
        last row), or None when the step does not fit the graphs (then it runs eagerly)."""
        decode = [item for item in items if item.num_new_tokens == 1]
        prefill = [item for item in items if item.num_new_tokens > 1]
        if not self.graphs.fits(len(decode)) or prefill and (
                self.prefill_graphs is None or len(prefill) > self.prefill_graphs.max_spans):
            return None
        spans = [self._prefill_span(item) for item in prefill]
        if None in spans:
            return None
        keys = sum(len(kv_slots) for *_, kv_slots in spans)  # the spans' keys, packed
        if spans and self.prefill_graphs.bucket(keys) is None:
            return None
        staged = self.prefill_graphs.stage(spans) if spans else None
        parts = []
        if decode:
            part = self._replay_decode_graph(decode, previous)
            if part is None:
                return None
            parts.append(part)
        if prefill:
            bounds = [(item.request, item.request.num_computed_tokens,
                       item.request.num_computed_tokens + item.num_new_tokens) for item in prefill]
            embeds = self.model.embed_request_spans(bounds, staged) if self.model.embeds_requests else None
            parts.append(self.prefill_graphs.replay(len(prefill), staged.shape[0], keys, embeds))
        items = decode + prefill
        query_start = [0]
        for item in items:
            query_start.append(query_start[-1] + item.num_new_tokens)
        if len(parts) == 1:
            hidden, logits, captured = parts[0]
        else:  # (hidden, logits, captured) of each part, joined in item order
            hidden, logits = (torch.cat(pair) for pair in zip(*(part[:2] for part in parts)))
            captured = {k: torch.cat([part[2][k] for part in parts]) for k in parts[0][2]}
        return items, query_start, hidden, captured, logits

    def _replay_decode_graph(self, items: list[ScheduledRequest], previous: PendingTokens | None):
        """A step's single-token rows through the decode graph: (hidden, logits, captured), or None
        when it cannot take them (fractional M-RoPE positions: the graph's position buffer holds
        integers)."""
        bs = self.block_size
        reqs = [item.request for item in items]
        steps = [r.num_computed_tokens for r in reqs]
        positions: list = steps
        if self.model.uses_mrope:
            positions = [self.model.decode_positions(r, p) for r, p in zip(reqs, steps)]
            if any(isinstance(v, float) for row in positions for v in row):
                return None
        ids = self.graphs.stage_inputs([r.token_ids[p] for r, p in zip(reqs, steps)], positions,
                                       [r.block_ids[p // bs] * bs + p % bs for r, p in zip(reqs, steps)],
                                       [r.block_ids for r in reqs], [p + 1 for p in steps])
        _fill_placeholders(ids, list(range(len(reqs))), reqs, previous)
        embeds = None
        if self.model.embeds_requests:
            embeds = self.model.embed_request_spans([(r, p, p + 1) for r, p in zip(reqs, steps)], ids)
        return self.graphs.replay(len(reqs), embeds)

    def _prefill_span(self, item: ScheduledRequest):
        """One request's prefill span as a prefill graph takes it (PrefillGraphs.stage), or None
        when no graph takes it (too long, refused by the model, fractional M-RoPE positions,
        prompt embeddings of a model that embeds by id)."""
        req, start = item.request, item.request.num_computed_tokens
        end = start + item.num_new_tokens
        if self.prefill_graphs.bucket(end) is None or not self.model.prefill_graphable(req) or (
                req.prompt_embeds is not None and not self.model.embeds_requests):
            return None
        if self.model.uses_mrope:
            positions = self.model.request_positions(req, start, end)
            if positions.is_floating_point():
                return None
        else:
            positions = range(start, end)
        bs, blocks = self.block_size, req.block_ids
        kv_slots = [blocks[p // bs] * bs + p % bs for p in range(end)]
        return req.token_ids[start:end], positions, kv_slots[start:], kv_slots

    def _prepare(self, items: list[ScheduledRequest], previous: PendingTokens | None) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        bs = self.block_size
        for item in items:
            req, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = req.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(end - start)
            seq_lens.append(end)
        max_blocks = max(len(item.request.block_ids) for item in items)
        # One tensor from one padded list: a tensor per row costs ~15 us each at large batch.
        block_tables = torch.tensor(
            [item.request.block_ids + [0] * (max_blocks - len(item.request.block_ids)) for item in items],
            dtype=torch.long,
        )
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True),
            query_start_loc=torch.tensor(query_start, dtype=torch.long).to(device, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long).to(device, non_blocking=True),
            block_tables=block_tables.to(device, non_blocking=True),
            block_size=bs,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        ids = torch.tensor(input_ids, dtype=torch.long).to(device, non_blocking=True)
        _fill_placeholders(ids, [query_start[i + 1] - 1 for i in range(len(items))], [item.request for item in items],
                           previous)
        return StepInputs(
            input_ids=ids,
            positions=self._positions(items, positions),
            inputs_embeds=self._input_embeds(items, ids, query_start),
            meta=meta,
            query_start=query_start,
        )

    def _sample(self, reqs: list[Request], logits: torch.Tensor, previous: PendingTokens | None) -> PendingSample:
        batch = SamplingBatch(
            params=[r.sampling_params for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            generators=[r.generator for r in reqs],
            owners=reqs,
            placeholder_value=None if previous is None else lambda i: previous.value_of(reqs[i]),
        )
        return self.sampler.sample(logits, batch)

    def _positions(self, items, positions: list[int]) -> torch.Tensor:
        """[T] token positions, or [3, T] for models with multimodal rotary (M-RoPE), whose
        positions depend on the request's inputs and are computed by the model."""
        if not self.model.uses_mrope:
            return torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        if all(item.num_new_tokens == 1 for item in items):  # a decode step: the models' cheap hook
            rows = [self.model.decode_positions(item.request, p) for item, p in zip(items, positions)]
            return torch.tensor(rows).T.to(self.device)
        spans = [
            self.model.request_positions(item.request, item.request.num_computed_tokens,
                                         item.request.num_computed_tokens + item.num_new_tokens)
            for item in items
        ]
        return torch.cat(spans, dim=-1).to(self.device)

    def _input_embeds(self, items, ids: torch.Tensor, query_start: list[int]) -> torch.Tensor | None:
        """Input embeddings when some request's inputs are more than token ids.

        Models with their own per-request inputs (`embeds_requests`) embed every span;
        otherwise prompt positions are replaced where a request brings `prompt_embeds`.
        """
        if self.model.embeds_requests:
            spans = [(item.request, item.request.num_computed_tokens,
                      item.request.num_computed_tokens + item.num_new_tokens) for item in items]
            return self.model.embed_request_spans(spans, ids)
        if not any(item.request.prompt_embeds is not None for item in items):
            return None
        embeds = self.model.get_input_embeddings(ids)
        for i, item in enumerate(items):
            req = item.request
            start = req.num_computed_tokens
            end = min(start + item.num_new_tokens, req.num_prompt_tokens)
            if req.prompt_embeds is None or start >= end:
                continue
            rows = req.prompt_embeds[start:end].to(device=embeds.device, dtype=embeds.dtype)
            embeds[query_start[i] : query_start[i] + end - start] = rows
        return embeds

    def _slice_hidden_states(self, items, query_start, hidden, captured, out: RunnerOutput) -> None:
        spans = {item.request.request_id: (query_start[i], query_start[i + 1])
                 for i, item in enumerate(items) if item.request.return_hidden_states}
        out.hidden_states.add({**captured, LAST: hidden}, spans)


def _fill_placeholders(ids: torch.Tensor, last_rows: list[int], requests: list[Request],
                       previous: PendingTokens | None) -> None:
    """ids[last_rows[i]] is the last input token of requests[i]: where that token is a placeholder,
    its value comes from the previous step's tokens on the device."""
    rows = [row for row, r in zip(last_rows, requests) if r.has_placeholder]
    if rows:
        previous.copy_into(ids, rows, [r for r in requests if r.has_placeholder])
