"""Host tensors onto the device without making the host wait."""
from __future__ import annotations

import torch


def to_device_nowait(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. On CUDA a copy from pageable host memory first waits for all work queued
    on the stream (a step's forward); from pinned memory it is only queued."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
