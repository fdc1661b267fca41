"""The documented scheduler name for autoregressive stages (spec 000 `scheduler_cls`)."""
from vllm_omni.core.scheduler import Scheduler


class OmniARScheduler(Scheduler):
    """Continuous batching with chunked prefill, prefix caching and preemption."""


__all__ = ["OmniARScheduler"]
