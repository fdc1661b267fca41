"""Layerwise offload on a GPU (diffusion/layerwise_offload.py): pinned CPU copies, the next block
copied on a side stream while one computes, events between the streams. The outputs equal the
resident blocks' exactly, the offloaded blocks hold two blocks' worth of device memory, and the
copies overlap the compute (the run takes less than compute plus copies one after the other)."""
from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_omni.diffusion.layerwise_offload import LayerwiseOffload  # noqa: E402

DIM, BLOCKS = 2048, 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _timed(fn, x, repeats: int = 5) -> tuple[torch.Tensor, float]:
    fn(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(x)
    torch.cuda.synchronize()
    return out, (time.perf_counter() - start) / repeats


@torch.inference_mode()
def test_offloaded_blocks_compute_the_same_with_two_blocks_of_memory():
    torch.manual_seed(0)
    cpu_blocks = nn.Sequential(*(Block() for _ in range(BLOCKS))).to(torch.bfloat16)
    resident = copy.deepcopy(cpu_blocks).cuda()
    x = torch.randn(16384, DIM, device="cuda", dtype=torch.bfloat16)  # compute about as long as the copies
    want, resident_s = _timed(resident, x)
    block_bytes = sum(p.numel() * p.element_size() for p in resident[1].parameters())
    del resident
    torch.cuda.empty_cache()

    before = torch.cuda.memory_allocated()
    offload = LayerwiseOffload.install(list(cpu_blocks), torch.device("cuda"))
    cpu_blocks[0].cuda()  # the first block stays on the device; the others are views of the ring
    assert all(b.host.is_pinned() for b in offload.blocks)
    assert torch.cuda.memory_allocated() - before <= 3.2 * block_bytes  # ring of 2 + the first block
    got, offloaded_s = _timed(cpu_blocks, x)
    assert torch.equal(got, want)

    # Copies alone: every offloaded block once, one after the other on the copy stream.
    start = time.perf_counter()
    for block in offload.blocks:
        offload.ring[0][:block.host.numel()].copy_(block.host, non_blocking=True)
    torch.cuda.synchronize()
    copies_s = time.perf_counter() - start
    print(f"resident {resident_s * 1e3:.1f} ms, offloaded {offloaded_s * 1e3:.1f} ms, copies alone "
          f"{copies_s * 1e3:.1f} ms")
    assert offloaded_s < resident_s + copies_s  # overlapped, not serialized


def test_wan_experts_offloaded_on_cuda_make_the_same_video(tiny_model):
    """Wan2.2 A14B (tiny) on CUDA: each expert's blocks offloaded to pinned CPU memory, the video
    crossing the expert boundary equals the resident model's (with cpu_offload too: the experts'
    blocks stay where layerwise offload put them, only the text encoder and the VAE visit)."""
    from tests.diffusion.conftest import WanCase, run_engine, video_of
    from vllm_omni.diffusion.engine import DiffusionEngine
    from vllm_omni.model_executor.models.wan2_2.model import WanModel

    folder, cuda = tiny_model("wan2_2", layout="a14b"), torch.device("cuda")
    case = WanCase("a", "a red fox running in the snow",
                   params=dict(height=32, width=48, num_frames=5, num_inference_steps=4, guidance_scale=4.0, seed=5))

    def video(**load):
        model = WanModel.load(folder, device=cuda, dtype=torch.float32, **load)
        return video_of(run_engine(DiffusionEngine(model, stage_id=0, max_batch_size=2), [case])["a"])

    want = video()
    offloads = []
    got = video(cpu_offload=True, offload_blocks=lambda blocks, device: offloads.append(
        LayerwiseOffload.install(blocks, device)))
    assert len(offloads) == 2 and all(o.copies > 0 and o.cuda for o in offloads)
    assert all(b.host.is_pinned() for o in offloads for b in o.blocks)
    assert (got - want).abs().max() <= 1e-5
