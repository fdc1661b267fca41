"""VLLM_OMNI_LOG_COMPILES=1: a stage logs each Triton kernel compiled while serving (serving_stalls.py)."""
from __future__ import annotations

import logging

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from vllm_omni.engine.serving_stalls import COMPILES_ENV, log_kernel_compiles  # noqa: E402


@triton.jit
def _fill(out_ptr, value, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, value + offsets * 0.0)


def test_a_kernel_compiled_after_start_up_is_logged(monkeypatch, caplog):
    from triton import knobs

    monkeypatch.setenv(COMPILES_ENV, "1")
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    log_kernel_compiles("stage 7")
    out = torch.empty(64, device="cuda")
    with caplog.at_level(logging.WARNING, logger="vllm_omni.engine.serving_stalls"):
        _fill[(1,)](out, 3.0, BLOCK=64)
        torch.cuda.synchronize()
    assert torch.all(out == 3.0)  # the hook did not skip the launch
    assert any("stage 7: Triton kernel" in r.getMessage() and "_fill" in r.getMessage() for r in caplog.records)
