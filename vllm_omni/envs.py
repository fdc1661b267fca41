"""Every `VLLM_OMNI_*` environment switch: its name, type, default and what it does.

This module is the only place that reads them from the environment (vLLM's `envs.py` does the
same; tests/test_envs.py checks it). Code reads a switch where it needs it, `envs.PDL.get()`,
which reads the environment then (so a test or a benchmark may set it just before), and names
it by `envs.PDL.name` where it hands it to a child process. docs/environment.md's table is
rendered from here (`render_table`; a test keeps the two equal).

Values: a bool switch is the opposite of its default only when set to `0` (default on) or `1`
(default off); an unset or empty variable keeps the default.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Switch:
    name: str
    type: type  # bool, int, float or str
    default: Any  # None: unset (the help says what happens then)
    help: str

    def get(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        if self.type is bool:
            return (raw != "0") if self.default else (raw == "1")
        try:
            return self.type(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r}: must be {self.type.__name__}") from None


def _switch(name: str, type_: type, default: Any, help_: str) -> Switch:
    return Switch(f"VLLM_OMNI_{name}", type_, default, help_)


# --- the engines ---------------------------------------------------------------------------------
ASYNC_SCHEDULING = _switch("ASYNC_SCHEDULING", bool, True,
                           "`0`: AR stages read a step's tokens before launching the next (vLLM's async "
                           "scheduling off; docs/architecture.md)")
ATTENTION_BACKEND = _switch("ATTENTION_BACKEND", str, "auto",
                            "`torch`: CUDA AR stages use the portable torch attention instead of the "
                            "Triton / FlashAttention kernels (to compare the two)")
PREFILL_CUDA_GRAPHS = _switch("PREFILL_CUDA_GRAPHS", bool, True,
                              "`0`: AR prefill spans run eagerly instead of replaying prefill graphs (A/B runs)")
PDL = _switch("PDL", bool, True,
              "`0`: decode kernels launch one after another, without programmatic dependent launch "
              "(read once, at import)")
PREDICTOR_CUDA_GRAPHS = _switch("PREDICTOR_CUDA_GRAPHS", bool, True,
                                "`0`: the Qwen3 code predictors' frames run eagerly (A/B runs)")
REFERENCE_CUDA_GRAPHS = _switch("REFERENCE_CUDA_GRAPHS", bool, True,
                                "`0`: Qwen3-TTS's reference encoders (voice cloning) run eagerly")
DIT_CUDA_GRAPHS = _switch("DIT_CUDA_GRAPHS", bool, True,
                          "`0`: Qwen2.5-Omni token2wav's DiT evaluations run eagerly (docs/streaming.md)")
FUSED_VOCODER = _switch("FUSED_VOCODER", bool, True,
                        "`0`: the vocoders' layers run as torch's ops instead of the fused kernels (A/B runs)")
STEADY_CHUNK_GRAPHS = _switch("STEADY_CHUNK_GRAPHS", int, 4,
                              "rows of a streaming code2wav's steady-chunk graphs, the most later chunks a "
                              "step decodes; `0`: no steady graphs (docs/streaming.md)")
FIRST_CHUNK_HOLD = _switch("FIRST_CHUNK_HOLD", str, "deadline",
                           "when a playing stream due sooner holds a new stream's first chunk in a streaming "
                           "code2wav: `deadline` (whenever it is due sooner) or `margin` (only when it is close "
                           "to running dry; an A/B candidate, worker/playback_deadlines.py)")
DECODE_LANES = _switch("DECODE_LANES", bool, True,
                       "`0`: a streaming code2wav decodes every chunk in order on one CUDA stream, first "
                       "chunks behind later ones (A/B runs; worker/decode_lanes.py)")

# --- the runtime ---------------------------------------------------------------------------------
SECRET = _switch("SECRET", str, None,
                 "the cluster secret of the stage transport, unless `--omni-secret-file` names a file "
                 "(unset: the stage master listens on loopback only; engine/cluster_secret.py)")
LOCK_DIR = _switch("LOCK_DIR", str, None,
                   "directory of the per-device start-up locks (unset: `vllm_omni_locks` in the temp dir)")
REPLICA_ID = _switch("REPLICA_ID", str, None,
                     "set by the runtime in each replica's process: `0` .. num_replicas - 1")
PROFILE_DIR = _switch("PROFILE_DIR", str, None,
                      "where the step profiler writes `stage<N>-profile.txt` (unset: no profiling; "
                      "engine/step_profiler.py)")
PROFILE_STAGES = _switch("PROFILE_STAGES", str, "", "comma-separated stage ids the step profiler watches")
PROFILE_SKIP = _switch("PROFILE_SKIP", str, "50",
                       "engine steps before the profiler starts: `N`, or `stage:N,...` per stage (50 for others)")
PROFILE_STEPS = _switch("PROFILE_STEPS", int, 200, "engine steps the profiler records")
PROFILE_OPS = _switch("PROFILE_OPS", bool, True,
                      "`0`: the profiler keeps the step timeline only (no torch profiler)")
LOG_COMPILES = _switch("LOG_COMPILES", bool, False,
                       "`1`: a stage logs each Triton kernel it compiles (or loads from the disk cache) "
                       "after start-up, with how long it took (engine/serving_stalls.py)")
PROFILE_PYTHON = _switch("PROFILE_PYTHON", bool, False,
                         "`1`: the profiler also runs cProfile over the same steps")

# --- tests and benchmarks ------------------------------------------------------------------------
CACHE = _switch("CACHE", str, None,
                "where tiny checkpoints and the demo model are built (unset: `~/.cache/vllm_omni`)")
SLOW_REPLICAS = _switch("SLOW_REPLICAS", str, "",
                        "comma-separated replica ids whose engine steps `testing.slow_replica` slows down")
SLOW_STEP_S = _switch("SLOW_STEP_S", float, 0.05, "the delay a slowed replica adds to each step, in seconds")

SWITCHES: tuple[Switch, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Switch))


def render_table() -> str:
    """The Markdown table of every switch (docs/environment.md holds it verbatim)."""
    rows = ["| variable | type | default | what it does |", "| --- | --- | --- | --- |"]
    for s in sorted(SWITCHES, key=lambda s: s.name):
        if s.default is None or s.default == "":
            default = "unset" if s.default is None else "empty"
        else:
            default = f"`{int(s.default) if s.type is bool else s.default}`"
        rows.append(f"| `{s.name}` | {s.type.__name__} | {default} | {s.help} |")
    return "\n".join(rows) + "\n"
