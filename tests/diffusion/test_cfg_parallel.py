"""--cfg-parallel-size 2 on the CPU: the unconditional rows on a second process (gloo)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.diffusion.conftest import Case, image_of, run_engine
from tests.pipeline.conftest import pid_alive
from vllm_omni.config.diffusion_parallel import DiffusionParallelConfig
from vllm_omni.diffusion.process_group import DiffusionProcessGroup, ModelSpec
from vllm_omni.diffusion.tea_cache import TeaCache, TeaCacheConfig

QWEN_IMAGE = "vllm_omni.model_executor.models.qwen_image.model:QwenImageModel"
# Size 1 runs each step's conditional and unconditional rows in one forward, size 2 in two;
# float32 matmuls of those shapes round differently in the last bits.
RANK_TOLERANCE = 1e-5
CFG2 = DiffusionParallelConfig(cfg_parallel_size=2)


@pytest.fixture(scope="module")
def cfg_group(qwen_image_dir):
    group = DiffusionProcessGroup.start(ModelSpec(QWEN_IMAGE, str(qwen_image_dir), "float32"),
                                        ("tea_cache", {"rel_l1_thresh": 0.2}, False), torch.device("cpu"), CFG2,
                                        init_timeout_s=120)
    group.join()
    group.wait_loaded()
    yield group
    group.close()
    assert not group.processes[0].is_alive()


def test_two_ranks_give_the_images_of_one(make_engine, cfg_group, t2i_pipe):
    cases = [Case("g1", "a red fox", negative="blurry", params=dict(height=32, width=32, num_inference_steps=3, seed=1)),
             Case("g2", "a small wooden boat on a lake", negative="dark",
                  params=dict(height=32, width=32, num_inference_steps=2, seed=2, num_outputs_per_prompt=2)),
             Case("plain", "a cat", params=dict(height=32, width=32, num_inference_steps=3, seed=3))]
    one_rank = run_engine(make_engine(), cases)
    two_ranks = run_engine(make_engine(group=cfg_group), cases)
    for case in cases:
        a, b = image_of(one_rank[case.request_id]), image_of(two_ranks[case.request_id])
        assert (a - b).abs().max() <= RANK_TOLERANCE, case.request_id
        assert (b - case.reference(t2i_pipe)).abs().max() <= RANK_TOLERANCE


def test_rank_one_keeps_its_own_tea_cache(make_engine, cfg_group):
    """TeaCache per rank: rank 0 caches the conditional rows, rank 1 the unconditional ones."""
    case = Case("tc", "a red fox", negative="blurry", params=dict(height=32, width=32, num_inference_steps=12, seed=1))
    local = TeaCache(TeaCacheConfig(rel_l1_thresh=0.2))
    one_rank = image_of(run_engine(make_engine(cache=TeaCache(TeaCacheConfig(rel_l1_thresh=0.2))), [case])["tc"])
    two_ranks = image_of(run_engine(make_engine(cache=local, group=cfg_group), [case])["tc"])
    assert local.computed + local.skipped == 12  # only the conditional rows here
    assert local.skipped > 0
    assert (one_rank - two_ranks).abs().max() <= 1e-4


def test_rank_one_does_not_outlive_its_parent(qwen_image_dir, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(f"""
        import os, torch
        from vllm_omni.config.diffusion_parallel import DiffusionParallelConfig
        from vllm_omni.diffusion.process_group import DiffusionProcessGroup, ModelSpec
        if __name__ == "__main__":
            group = DiffusionProcessGroup.start(ModelSpec({QWEN_IMAGE!r}, {str(qwen_image_dir)!r}, "float32"), None,
                                                torch.device("cpu"), DiffusionParallelConfig(cfg_parallel_size=2),
                                                init_timeout_s=120)
            group.join()
            group.wait_loaded()
            print(group.processes[0].pid, flush=True)
            os.kill(os.getpid(), 9)  # rank 0 dies without closing anything
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          cwd=Path(__file__).resolve().parents[2])
    rank1 = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while pid_alive(rank1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(rank1), "rank 1 outlived rank 0"
