"""Stage process lifecycle: parent-death signal, termination and the spawn start method (spec 002)."""
from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import subprocess
import sys

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def set_death_signal(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (best effort).

    Uses prctl(PR_SET_PDEATHSIG); a no-op on other platforms and never raises.
    Note the kernel fires it when the parent *thread* that created this process
    exits, and not at all if the parent died before this call.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG, %s) failed: %s", sig, os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError, TypeError, ValueError) as e:
        logger.warning("cannot set the parent-death signal: %s", e)


def terminate_alive_proc(proc: mp.Process | subprocess.Popen, timeout: float = 5) -> None:
    """Stop ``proc``: SIGTERM, wait up to ``timeout`` s, then SIGKILL and reap.

    Accepts ``multiprocessing.Process`` and ``subprocess.Popen``; no-op when
    the process has already exited.
    """
    if isinstance(proc, subprocess.Popen):
        if proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.warning("pid %s ignored SIGTERM for %ss; killing it", proc.pid, timeout)
            proc.kill()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:  # e.g. stuck in uninterruptible I/O
                logger.error("pid %s still alive %ss after SIGKILL", proc.pid, timeout)
        return
    if not proc.is_alive():
        return
    proc.terminate()
    proc.join(timeout)
    if proc.is_alive():
        logger.warning("pid %s ignored SIGTERM for %ss; killing it", proc.pid, timeout)
        proc.kill()
        proc.join(timeout)


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
