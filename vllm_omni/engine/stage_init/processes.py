"""Stage process lifecycle: parent-death signal, termination and the spawn start method (spec 002)."""
from __future__ import annotations

import logging
import multiprocessing as mp

# Defined with the AR engine, whose tensor-parallel ranks use them too; spec 002 names them here.
from vllm_omni.core.child_processes import set_death_signal, terminate_alive_proc  # noqa: F401

logger = logging.getLogger(__name__)


def prepare_engine_environment() -> None:
    """One-time global setup: the ``spawn`` start method for stage processes.

    CUDA cannot be used in a forked child, so stages must be spawned. Sets it
    only when no start method was chosen yet (idempotent); an explicit other
    choice is left alone. Stage launchers spawn through an explicit "spawn"
    context either way, so another global method (libraries fix it as a side
    effect of asking for it) changes nothing for stages: no warning. (Upstream
    also loads plugins here; we have no plugin system: user code comes in
    through dotted paths.)
    """
    current = mp.get_start_method(allow_none=True)
    if current is None:
        mp.set_start_method("spawn")
    elif current != "spawn":
        logger.debug("multiprocessing start method is %r; stage processes are spawned regardless", current)
