"""Per-stage runtime environment: ``runtime.env`` and ``runtime.devices`` (spec 002)."""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from vllm_omni.engine.stage_init.devices import setup_stage_devices
from vllm_omni.engine.stage_init.readers import RuntimeView

logger = logging.getLogger(__name__)


def _env_value(value: Any) -> str:
    # YAML gives bools and ints; env flags conventionally read "1"/"0".
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


@contextlib.contextmanager
def stage_runtime_env(stage_id: int, runtime_cfg: Any) -> Iterator[None]:
    """Apply ``runtime.env`` to os.environ for the block; restore exactly on exit.

    A value of None unsets the variable inside the block. Variables that did
    not exist before are removed again on exit, also when the block raises.
    """
    env = RuntimeView.of(runtime_cfg).env or {}
    if not isinstance(env, Mapping):
        raise ValueError(f"Stage {stage_id}: runtime.env must be a mapping of names to values, "
                         f"got {type(env).__name__}")
    saved = {str(k): os.environ.get(str(k)) for k in env}
    try:
        for key, value in env.items():
            if value is None:
                os.environ.pop(str(key), None)
            else:
                os.environ[str(key)] = _env_value(value)
        if env:
            logger.debug("Stage %s runtime env: %s", stage_id, sorted(saved))
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextlib.contextmanager
def stage_runtime_setup(stage_id: int, runtime_cfg: Any) -> Iterator[None]:
    """Apply ``runtime.env`` and ``runtime.devices`` for the block.

    ``runtime.env`` is restored on exit. Device visibility restore remains the
    caller's responsibility (save/restore CUDA_VISIBLE_DEVICES around this
    block when launching in-process). The env is applied first, so a
    CUDA_VISIBLE_DEVICES set in ``runtime.env`` is the pool ``runtime.devices``
    indexes into, and it is restored along with the rest of the env.
    """
    with stage_runtime_env(stage_id, runtime_cfg):
        setup_stage_devices(stage_id, runtime_cfg)
        yield
