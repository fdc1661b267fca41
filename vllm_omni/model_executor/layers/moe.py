"""Top-k mixture of experts with fused expert weights.

Experts live in two stacked tensors, as fused MoE kernels want them:
  w13 [E, 2*I, H]: rows [gate | up] of each expert (HF `gate_proj`, `up_proj`)
  w2  [E, H, I]:   each expert's `down_proj`
Checkpoints store them per expert (`experts.{i}.gate_proj.weight`, ...); transformers 5.x
fuses them in memory too but `save_pretrained` writes this per-expert hub layout.

Routing matches transformers' Qwen3MoeTopKRouter: router logits in the model dtype,
softmax in float32, top-k, optional renormalization in float32, weights cast back.

Tensor parallelism shards every expert's intermediate dimension (vLLM's default without
expert parallelism): each rank holds all experts with I/N rows of gate/up and I/N columns
of down, routes every token the same way (the router is replicated), and the block sums the
ranks' partial outputs. Unlike expert parallelism, each rank's work and memory do not depend
on where tokens are routed, decode reads exactly 1/N of every active expert on every rank,
and the kernels are the same ones with a smaller I.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni.model_executor.layers.activation import get_gated_act, silu_and_mul
from vllm_omni.model_executor.layers.linear import Linear, copy_shard, set_sharded_loader
from vllm_omni.model_executor.parallel_state import current_tp_group

_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_W13_SHARD = {"gate_proj": 0, "up_proj": 1}


def map_expert_weight_name(name: str) -> tuple[str, tuple[int, int | None]] | None:
    """HF per-expert name -> (our fused parameter name, shard id), or None if not an expert weight.

    `x.experts.3.up_proj.weight` -> (`x.experts.w13_weight`, (3, 1));
    `x.experts.3.down_proj.weight` -> (`x.experts.w2_weight`, (3, None)).
    """
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    expert, proj = int(match["expert"]), match["proj"]
    if proj == "down_proj":
        return f"{match['prefix']}.w2_weight", (expert, None)
    return f"{match['prefix']}.w13_weight", (expert, _W13_SHARD[proj])


# Which expert kernels a step takes on CUDA in half precision (benchmarks/bench_moe_decode.py on
# the H200, docs/benchmarks.md round 19):
# - while its (token, slot) pairs route at most FEW_ROUTED_BYTES_MAX of expert weights (a pair
#   reads its expert's three matrices): `moe_ops.few_token_experts`, each pair reading its expert
#   through the id, 4x faster than the grouped path at one token. Where the expert-sorted kernels
#   overtake them depends on the experts' size, not on the pair count alone: the Qwen3-Omni
#   talker's (2.4 MB) between 24 and 48 pairs, its thinker's (9.4 MB) between 8 and 16;
# - then up to SORTED_TOKEN_MAX tokens: `moe_ops.sorted_experts`, each expert's weights read once
#   for all its pairs, 1.7-2.7x faster than the grouped path at 16-128 tokens;
# - beyond (prefill), the grouped GEMMs.
FEW_ROUTED_BYTES_MAX = 96 << 20
SORTED_TOKEN_MAX = 128


def takes_few_token_experts(w2: torch.Tensor, topk_ids: torch.Tensor) -> bool:
    """Whether a step of these routed pairs takes `moe_ops.few_token_experts` (see above)."""
    return topk_ids.numel() * 3 * w2[0].numel() * w2.element_size() <= FEW_ROUTED_BYTES_MAX


def _half_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]).
    On CUDA in half precision one kernel (`moe_ops.route`)."""
    if _half_cuda(router_logits):
        from vllm_omni.model_executor.layers import moe_ops

        return moe_ops.route(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def _sort_by_expert(topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (flat ids [T*k], order: the (token, slot) pairs grouped by expert
    (stable), token_idx: the token of each pair in that order)."""
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    return flat_ids, order, order // topk_ids.shape[1]


def moe_forward_reference(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """Loop over the experts that received tokens; correct on any device.

    One device->host sync (the per-expert counts), so it cannot be captured in a CUDA
    graph; a fused kernel replaces it there. Experts are accumulated in ascending order,
    as transformers does, so float sums round the same way.
    """
    num_experts = w13.shape[0]
    out = torch.zeros_like(x)
    flat_ids, order, token_idx = _sort_by_expert(topk_ids)  # token_idx: grouped by expert
    weights = topk_weights.flatten()[order]
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        idx = token_idx[start : start + count]
        hidden = silu_and_mul(F.linear(x[idx], w13[expert]))
        hidden = F.linear(hidden, w2[expert]) * weights[start : start + count, None]
        out.index_add_(0, idx, hidden.to(out.dtype))
        start += count
    return out


def moe_forward_grouped(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """All experts in two grouped GEMMs (torch._grouped_mm, Hopper, bf16).

    Token rows are sorted by expert and the group offsets stay on the device: no host
    sync, so a step with MoE layers can be captured in a CUDA graph. Each token's k expert
    outputs are put back in slot order and summed there (no atomics: the same inputs give the
    same bits, in a graph or not), which rounds differently from the reference loop.
    """
    num_experts = w13.shape[0]
    flat_ids, order, token_idx = _sort_by_expert(topk_ids)
    # scatter_add, not bincount: bincount reads the max id back to the host (no graph capture).
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    hidden = torch._grouped_mm(x[token_idx], w13.transpose(1, 2), offs=offsets)  # [T*k, 2I]
    hidden = torch._grouped_mm(silu_and_mul(hidden), w2.transpose(1, 2), offs=offsets)  # [T*k, H]
    per_slot = torch.empty_like(hidden)
    per_slot[order] = hidden * topk_weights.flatten()[order, None]  # back to (token, slot) order
    return per_slot.view(*topk_ids.shape, -1).sum(dim=1).to(x.dtype)


def grouped_mm_available(x: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


class FusedExperts(nn.Module):
    """The experts of one MoE layer; parameter names `w13_weight`, `w2_weight`. Over N
    tensor-parallel ranks each holds I/N of every expert's intermediate dimension."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.full_intermediate_size = intermediate_size
        self.shard_start, self.intermediate_size = current_tp_group().shard_range(
            intermediate_size, "moe_intermediate_size")
        local = self.intermediate_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, local), requires_grad=False)
        experts = range(num_experts)
        set_sharded_loader(self.w13_weight, self._load_w13, [(e, s) for e in experts for s in (0, 1)])
        set_sharded_loader(self.w2_weight, self._load_w2, [(e, None) for e in experts])

    def _load_w13(self, param: torch.Tensor, loaded, shard_id: tuple[int, int]) -> None:
        expert, half = shard_id
        size = self.intermediate_size
        copy_shard(param[expert, half * size : (half + 1) * size], loaded, 0, self.shard_start,
                   self.full_intermediate_size, f"expert {expert} {'up' if half else 'gate'}_proj")

    def _load_w2(self, param: torch.Tensor, loaded, shard_id: tuple[int, None]) -> None:
        expert = shard_id[0]
        copy_shard(param[expert], loaded, 1, self.shard_start, self.full_intermediate_size,
                   f"expert {expert} down_proj")

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if _half_cuda(x) and x.shape[0] <= SORTED_TOKEN_MAX:
            from vllm_omni.model_executor.layers import moe_ops

            few = takes_few_token_experts(self.w2_weight, topk_ids)
            experts = moe_ops.few_token_experts if few else moe_ops.sorted_experts
            return experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        if grouped_mm_available(x):
            return moe_forward_grouped(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return moe_forward_reference(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, HF name `mlp.gate.weight`) plus fused experts."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        hidden_act: str = "silu",
    ):
        super().__init__()
        get_gated_act(hidden_act)  # validates: the expert kernel hard-codes SiLU-and-mul
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.tp = current_tp_group()
        self.gate = Linear(hidden_size, num_experts, bias=False)  # replicated: every rank routes alike
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.norm_topk_prob)
        return self.tp.all_reduce(self.experts(x, topk_weights, topk_ids))
