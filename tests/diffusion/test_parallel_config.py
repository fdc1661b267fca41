"""The diffusion parallel settings at the config edge: serve flags, stage fields, upstream's nested
`parallel_config`, the world they make and every combination that is refused (with the field and
the reason); TeaCache and cache-dit following their branch leader's decisions."""
from __future__ import annotations

import argparse

import pytest
import torch

from vllm_omni.config import ConfigError, load_pipeline_config
from vllm_omni.config.diffusion_parallel import DiffusionParallelConfig
from vllm_omni.diffusion.db_cache import DBCache, DBCacheConfig
from vllm_omni.diffusion.tea_cache import TeaCache, TeaCacheConfig
from vllm_omni.entrypoints.cli import serve_args

QWEN_IMAGE = {"architectures": ["QwenImagePipeline"]}


def _stage(cli=None, overrides=None):
    return load_pipeline_config(model=QWEN_IMAGE, cli_args=cli, stage_overrides=overrides, platform="cpu").stage(0)


def _devices(n: int) -> dict:
    return {"0": {"devices": ",".join(str(i) for i in range(n))}}


def test_serve_flags_reach_the_diffusion_stage():
    parser = argparse.ArgumentParser()
    serve_args.add_arguments(parser)
    args = parser.parse_args(["model", "--usp", "2", "--ring", "2", "--ulysses-mode", "advanced_uaa", "--use-hsdp",
                              "--hsdp-shard-size", "2", "--hsdp-replicate-size", "2", "--vae-patch-parallel-size", "4",
                              "--num-gpus", "4"])
    assert serve_args.refused_flags(args) == []
    stage = _stage(serve_args.engine_args(args), _devices(4))
    parallel = stage.engine_args.diffusion_parallel
    assert parallel.describe() == {"world_size": 4, "cfg_parallel_size": 1, "ulysses_degree": 2, "ring_degree": 2,
                                   "ulysses_mode": "advanced_uaa", "vae_patch_parallel_size": 4, "hsdp": [2, 2]}
    assert stage.engine_args.devices_per_replica == 4


def test_upstream_parallel_config_sets_the_same_fields():
    nested = {"engine_args": {"parallel_config": {
        "ulysses_degree": 2, "ring_degree": 2, "cfg_parallel_size": 1, "tensor_parallel_size": 1,
        "data_parallel_size": 1, "pipeline_parallel_size": 1, "enable_expert_parallel": False,
        "sequence_parallel_size": None, "use_hsdp": False, "hsdp_shard_size": -1, "hsdp_replicate_size": 1}}}
    ea = _stage(None, {"0": {"devices": "0,1,2,3", **nested}}).engine_args
    assert (ea.ulysses_degree, ea.ring_degree, ea.diffusion_parallel.world_size) == (2, 2, 4)
    flat = _stage(None, {"0": {"devices": "0,1", "parallel_config": {"cfg_parallel_size": 2}}}).engine_args
    assert flat.cfg_parallel_size == 2
    refused = [({"tensor_parallel_size": 2}, "tensor parallelism of the diffusion transformer"),
               ({"allgather_degree": 2}, "allgather_degree is not supported"),
               ({"data_parallel_size": 2}, "data_parallel_size"),
               ({"ulysses_degre": 2}, "did you mean 'ulysses_degree'"),
               ({"ring_degree": 0}, "parallel_config.ring_degree=0")]
    for given, message in refused:
        with pytest.raises(ConfigError, match=message):
            _stage(None, {"0": {"parallel_config": given}})


@pytest.mark.parametrize("cli, devices, field, message", [
    (dict(ulysses_degree=2), 1, "runtime.devices", r"lists 1 device\(s\) but .* ulysses_degree=2 .* needs 2"),
    (dict(ulysses_degree=2, num_gpus=4), 2, "engine_args.num_gpus", "num_gpus=4 but the parallel degrees make a "
                                                                     "world of 2"),
    (dict(use_hsdp=True), 1, "engine_args.hsdp_shard_size", "standalone HSDP .* needs hsdp_shard_size"),
    (dict(hsdp_shard_size=2), 1, "engine_args.hsdp_shard_size", "set but use_hsdp is false"),
    (dict(ring_degree=2, use_hsdp=True, hsdp_shard_size=4), 2, "engine_args.hsdp_shard_size",
     "= 4 must equal the world of the other degrees, 2"),
    (dict(cfg_parallel_size=2, use_hsdp=True), 2, "engine_args.hsdp_replicate_size", "stays inside one CFG branch"),
    (dict(vae_patch_parallel_size=2), 1, "engine_args.vae_patch_parallel_size", "more than the stage's 1 rank"),
    (dict(ulysses_degree=2, vae_patch_parallel_size=2, vae_use_tiling=True), 2, "engine_args.vae_use_tiling",
     "choose one"),
    (dict(ring_degree=2, diffusion_load_format="diffusers"), 2, "engine_args.diffusion_load_format",
     "the diffusers adapter runs a whole pipeline in one process"),
    # Ring attention merges key blocks by the log-sum-exp that cuDNN's SDPA path does not return.
    (dict(ring_degree=2, diffusion_attention_config={"per_role": {"joint": {"backend": "CUDNN_ATTN"}}}), 2,
     "engine_args.ring_degree", "the CUDNN_ATTN backend is set"),
    (dict(ring_degree=2, diffusion_attention_backend="cudnn_attn"), 2, "engine_args.ring_degree", "CUDNN_ATTN"),
    (dict(ulysses_degree=2, use_hsdp=True, diffusion_quantization_config={"method": "fp8"}), 2,
     "engine_args.use_hsdp", "FSDP2.* shards float weights"),
    # Layerwise offload keeps whole blocks in CPU memory; FSDP2 owns the sharded ones (i46-memory).
    (dict(ulysses_degree=2, use_hsdp=True, enable_layerwise_offload=True), 2, "engine_args.enable_layerwise_offload",
     "use_hsdp shards those weights"),
    (dict(use_hsdp=True, hsdp_shard_size=2, enable_layerwise_offload=True), 2, "engine_args.enable_layerwise_offload",
     "choose one"),
    # Sleep mode rebuilds the stage's engine in its own process: not the other ranks'.
    (dict(ulysses_degree=2, enable_sleep_mode=True), 2, "engine_args.ulysses_degree",
     "does not combine with enable_sleep_mode"),
    (dict(use_hsdp=True, hsdp_shard_size=2, enable_sleep_mode=True), 2, "engine_args.use_hsdp",
     "does not combine with enable_sleep_mode"),
])
def test_combinations_that_cannot_run_are_refused_naming_the_field(cli, devices, field, message):
    with pytest.raises(ConfigError, match=message) as e:
        _stage(cli, _devices(devices))
    assert e.value.field == field


def test_layerwise_offload_combines_with_sequence_and_cfg_parallelism():
    for cli in (dict(ulysses_degree=2), dict(ring_degree=2), dict(cfg_parallel_size=2)):
        ea = _stage({**cli, "enable_layerwise_offload": True}, _devices(2)).engine_args
        assert ea.enable_layerwise_offload and ea.diffusion_parallel.world_size == 2


def test_the_rank_layout_puts_ulysses_innermost():
    layout = DiffusionParallelConfig(cfg_parallel_size=2, ulysses_degree=2, ring_degree=2).check()
    assert layout.world_size == 8 and layout.branch_size == 4
    # rank = ((cfg x dp + dp) x ring + ring_rank) x ulysses + ulysses_rank
    assert [layout.coordinates(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0),
                                                                 (1, 0, 0, 1), (1, 0, 1, 1)]
    standalone = DiffusionParallelConfig(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2).check()
    assert (standalone.world_size, standalone.data_parallel_size, standalone.hsdp_shape) == (4, 4, (2, 2))
    assert DiffusionParallelConfig(ulysses_degree=4, use_hsdp=True, hsdp_replicate_size=2).hsdp_shape == (2, 2)


def test_tea_cache_follows_the_agreed_decisions():
    """A rank whose own distances say 'skip' computes when its branch leader computes, and the
    other way round, so that ranks running the blocks together call them for the same rows."""
    rows = torch.ones(2, 4, 3)

    def step(cache: TeaCache, modulated: torch.Tensor) -> None:
        cache.run(["a", "b"], modulated, rows, lambda index: rows if index is None else rows[index] * 2)

    followers = {}
    for decision in (True, False):
        cache = TeaCache(TeaCacheConfig(rel_l1_thresh=0.5), agree=lambda flags, d=decision: [d] * len(flags))
        step(cache, torch.ones(2, 4, 8))
        step(cache, torch.ones(2, 4, 8))  # unchanged input: its own rule would skip both rows
        followers[decision] = (cache.computed, cache.skipped)
    assert followers == {True: (4, 0), False: (2, 2)}


def test_db_cache_follows_the_agreed_decisions():
    """cache-dit's DBCache too: a rank reuses (or computes) the rows its branch leader does,
    whatever its own residual diffs say."""
    config = DBCacheConfig(Fn_compute_blocks=1, max_warmup_steps=0, residual_diff_threshold=0.1,
                           max_continuous_cached_steps=-1)

    def run_range(rows, state, start, end):
        return state[0] * (1 + end - start), None  # each block doubles: the Fn residual is the input

    followers = {}
    for decision in (True, False):
        cache = DBCache(config, agree=lambda flags, d=decision: [d] * len(flags) if any(
            r.residual is not None for r in cache._rows.values()) else flags)
        cache.run(["a", "b"], 2, (torch.ones(2, 4, 3), None), run_range)
        cache.run(["a", "b"], 2, (torch.full((2, 4, 3), 5.0), None), run_range)  # its own rule: compute
        followers[decision] = (cache.computed, cache.skipped)
    assert followers == {True: (2, 2), False: (4, 0)}
