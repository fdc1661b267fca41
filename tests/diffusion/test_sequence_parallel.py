"""Sequence-parallel attention and row-band decoding across real ranks (gloo; processes forked from a forkserver).

One world of 4 ranks runs layouts of 2 and 4 ranks on tiny random tensors (a 2-rank grid as each
of two CFG branches) and compares each rank's slice with one process's result on the whole
tensors: Ulysses (all-to-all), ring (K/V blocks around the ring, log-sum-exp merge) and both
(Ulysses inside, ring across), with joint (replicated) tokens as Qwen-Image's prompt and without
(Wan2.2's self-attention), even and uneven sequence lengths and head counts (advanced_uaa), the
VAE's row bands with a halo on 2 and 4 ranks, and standalone HSDP (2 replicas x 2 shards).
"""
from __future__ import annotations

import datetime
import multiprocessing
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from vllm_omni.config.diffusion_parallel import DiffusionParallelConfig
from vllm_omni.diffusion.rank_groups import build_groups
from vllm_omni.model_executor.layers.diffusion_parallel import PatchGroup, decode_row_bands
from vllm_omni.model_executor.layers.sequence_parallel import SequenceParallelAttention

# What the ranks import on their first collective, HSDP shard and comparison (torch imports them lazily).
RANK_IMPORTS = ["torch.distributed.fsdp", "torch.distributed.tensor", "torch._dynamo", "torch.testing"]
TOLERANCE = 1e-5  # float32: attention over key blocks merged by log-sum-exp rounds differently
CPU = torch.device("cpu")

WORLD = 4
# (cfg branches, ulysses, ring, mode, sequence length, heads): grids of 2 ranks (in each of two CFG
# branches) and of 4.
LAYOUTS = [(2, 2, 1, "strict", 6, 4), (2, 2, 1, "advanced_uaa", 7, 3), (2, 1, 2, "strict", 6, 3),
           (2, 1, 2, "advanced_uaa", 7, 3), (1, 2, 2, "strict", 8, 4), (1, 2, 2, "advanced_uaa", 11, 3),
           (1, 4, 1, "advanced_uaa", 9, 6), (1, 1, 4, "advanced_uaa", 10, 2)]


def _reference(q, k, v, joint=None):
    """One process: attention of [tokens, joint tokens] over all of them, [B, S, H, D]."""
    if joint is not None:
        q, k, v = (torch.cat([x, j], dim=1) for x, j in zip((q, k, v), joint))
    return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)


def _check_attention(rank: int, cfg: int, ulysses: int, ring: int, mode: str, seq: int, heads: int) -> None:
    layout = DiffusionParallelConfig(cfg_parallel_size=cfg, ulysses_degree=ulysses, ring_degree=ring,
                                     ulysses_mode=mode)
    groups = build_groups(layout, rank, CPU)
    sp = groups.model.sequence
    generator = torch.Generator().manual_seed(seq * 31 + heads)  # the same tensors on every rank
    q, k, v = (torch.randn(2, seq, heads, 8, generator=generator) for _ in range(3))
    joint = tuple(torch.randn(2, 3, heads, 8, generator=generator) for _ in range(3))
    plan = sp.plan(seq)
    attention = SequenceParallelAttention(sp)
    local = [plan.local(x, 1) for x in (q, k, v)]
    expected = _reference(q, k, v, joint)
    out, joint_out = attention(*local, plan, joint=joint)
    where = f"rank {rank}: cfg {cfg} x ulysses {ulysses} x ring {ring}, {mode}, {seq} tokens, {heads} heads"
    torch.testing.assert_close(out, plan.local(expected[:, :seq], 1), atol=TOLERANCE, rtol=0, msg=where)
    torch.testing.assert_close(joint_out, expected[:, seq:], atol=TOLERANCE, rtol=0, msg=where)
    torch.testing.assert_close(plan.gather(out, 1), expected[:, :seq], atol=TOLERANCE, rtol=0, msg=where)
    alone = attention(*local, plan)  # no joint tokens: plain self-attention over the split sequence
    torch.testing.assert_close(alone, plan.local(_reference(q, k, v), 1), atol=TOLERANCE, rtol=0, msg=where)


def _check_row_bands(rank: int, bands: int) -> None:
    """A conv / 2x upsample / conv decoder: 1 feature row, then 3 output rows = 1.5 feature rows
    deep, so a halo of 2 rows is exact and 1 is not."""
    torch.manual_seed(0)
    decoder = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Upsample(scale_factor=2),
                                  torch.nn.Conv2d(4, 2, 3, padding=1))
    features = torch.randn(2, 3, 13, 5)
    layout = DiffusionParallelConfig(ulysses_degree=WORLD, vae_patch_parallel_size=bands)
    patch: PatchGroup | None = build_groups(layout, rank, CPU).model.vae
    if patch is None:  # not one of the decoding ranks
        assert rank >= bands
        return
    with torch.no_grad():
        out = decode_row_bands(patch, features, halo=2, scale=2, decode=decoder)
        expected = decoder(features)
        short = decode_row_bands(patch, features, halo=1, scale=2, decode=decoder)
    if rank == 0:
        torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=0)
        assert (short - expected).abs().max() > 1e-3, "a halo short of the receptive field must show"
    else:
        assert out is None and short is None


def _check_standalone_hsdp(rank: int) -> None:
    """HSDP alone over the 4 ranks, (replicate 2 x shard 2): one branch of 4 replicas of the
    computation; each rank keeps half of each sharded module and a forward gathers it."""
    from vllm_omni.model_executor.layers.diffusion_parallel import gathered, shard_with_hsdp

    layout = DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2)
    groups = build_groups(layout, rank, CPU)
    assert (groups.branch, groups.branch_leader, groups.model.hsdp_mesh.shape) == (0, 0, (2, 2))
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 6))
    x = torch.randn(3, 6)
    with torch.no_grad():
        expected, first = blocks(x), blocks[0](x)
        shard_with_hsdp([blocks[0], blocks[2]], groups.model.hsdp_mesh)
        assert blocks[0].weight.to_local().shape == (4, 6)
        torch.testing.assert_close(blocks(x), expected, atol=0, rtol=0)
        with gathered(blocks[0]):  # the full weights, for code that does not call the module
            torch.testing.assert_close(F.linear(x, blocks[0].weight, blocks[0].bias), first, atol=0, rtol=0)
        assert blocks[0].weight.to_local().shape == (4, 6)
    assert groups.agree([rank == 0, rank != 0]) == [True, False]  # the branch leader's decisions


def _world(rank: int, port: int) -> None:
    torch.set_num_threads(1)  # four ranks on a small machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for layout in LAYOUTS:
            _check_attention(rank, *layout)
        for bands in (2, 4):
            _check_row_bands(rank, bands)
        _check_standalone_hsdp(rank)
    finally:
        dist.destroy_process_group()


def test_every_layout_equals_one_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The ranks fork from a forkserver (a fresh single-threaded interpreter) that imported this
    # module and the torch parts the checks use once, rather than each rank importing them in a
    # spawned interpreter of its own (~2 s of CPU per rank, for tensors of a few hundred numbers).
    multiprocessing.set_forkserver_preload([__name__, *RANK_IMPORTS])
    mp.start_processes(_world, args=(port,), nprocs=WORLD, start_method="forkserver")


def test_strict_mode_refuses_what_it_cannot_split():
    from vllm_omni.model_executor.layers.sequence_parallel import SequenceParallelGroup

    strict = SequenceParallelGroup(2, 0, None, 2, 0, None, (0, 2), None, "strict")
    with pytest.raises(ValueError, match=r"head count \(3\) divisible by ulysses_degree=2.*\[1, 3\]"):
        strict.check_heads(3)
    with pytest.raises(ValueError, match=r"sequence length \(9 tokens\) divisible by ulysses_degree x ring_degree = 4"):
        strict.plan(9)
    assert strict.plan(8).lengths == (2, 2, 2, 2)
    uneven = SequenceParallelGroup(2, 0, None, 2, 0, None, (0, 2), None, "advanced_uaa")
    uneven.check_heads(3)
    # Ring chunks first (5, 4), each cut among its Ulysses pair.
    assert uneven.plan(9).lengths == (3, 2, 2, 2)
    with pytest.raises(ValueError, match="shorter than the sequence-parallel degree 4"):
        uneven.plan(3)
