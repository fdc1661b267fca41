"""A readable description of a resolved pipeline (check-config, startup logs)."""
from __future__ import annotations

from dataclasses import fields

from vllm_omni.config.stage_config import PipelineConfig, StageConfig
from vllm_omni.sampling_params import DiffusionSamplingParams, SamplingParams

_TABLE_ENGINE_FIELDS = {"model_stage", "model_arch", "worker_type", "worker_cls", "scheduler_cls",
                        "engine_output_type", "gpu_memory_utilization", "tensor_parallel_size"}
_ALWAYS_SHOWN_SAMPLING = ("temperature", "top_p", "top_k", "max_tokens", "seed", "detokenize",
                          "repetition_penalty")


def describe_pipeline(pipeline: PipelineConfig) -> str:
    name = pipeline.pipeline_name or "-"
    lines = [f"Pipeline {name} ({pipeline.format.value} format) from {pipeline.source}",
             f"async_chunk={_fmt(pipeline.async_chunk)}  runtime: enabled={_fmt(pipeline.runtime.enabled)} "
             f"window_size={pipeline.runtime.window_size} max_inflight={pipeline.runtime.max_inflight}"
             + (f"  replica lb_policy={pipeline.lb_policy} (strategy file)" if pipeline.lb_policy else ""),
             "", "Stages"]
    header = ("id", "model_stage", "engine", "output", "devices", "process", "batch", "gpu_mem", "tp",
              "inputs", "final")
    rows = [header] + [_row(s) for s in pipeline.stages]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += ["", "Stage details"]
    for stage in pipeline.stages:
        lines += _details(stage)
    lines += ["", "Edges"]
    for e in pipeline.edges:
        window = "whole output" if e.window_size == -1 else f"every {e.window_size}"
        target = pipeline.stage(e.to_stage)
        via = target.custom_process_input_func or "token ids passed through"
        lines.append(f"  {e.from_stage} -> {e.to_stage}  window_size={e.window_size} ({window})  "
                     f"connector={e.connector or '-'}  input={via}")
    if not pipeline.edges:
        lines.append("  (none: single stage)")
    if pipeline.connectors:
        lines += ["", "Connectors"]
        for c in pipeline.connectors:
            extra = ", ".join(f"{k}={v!r}" for k, v in c.extra)
            lines.append(f"  {c.key}: {c.name}" + (f" ({extra})" if extra else ""))
    lines += ["", "Final outputs"]
    for s in pipeline.final_stages:
        lines.append(f"  stage {s.stage_id} ({s.model_stage or '-'}): {s.final_output_type.value}")
    tok = pipeline.comprehension_stage
    lines.append(f"Tokenizer from stage {tok.stage_id}" if tok else "Tokenizer: no comprehension stage")
    return "\n".join(lines)


def _row(s: StageConfig) -> tuple[str, ...]:
    a, r = s.engine_args, s.runtime
    inputs = ",".join(map(str, s.engine_input_source)) or "-"
    return (str(s.stage_id), a.model_stage or "-", a.worker_type.value, a.engine_output_type.value,
            r.devices, "yes" if r.process else "no", str(r.max_batch_size),
            f"{a.gpu_memory_utilization:.2f}", str(a.tensor_parallel_size), inputs,
            s.final_output_type.value if s.final_output else "-")


def _details(s: StageConfig) -> list[str]:
    a = s.engine_args
    out = [f"  [{s.stage_id}] {a.model_stage or '(unnamed stage)'}"]
    items = [("model_arch", a.model_arch), ("worker_cls", a.worker_cls), ("scheduler_cls", a.scheduler_cls),
             ("input_func", s.custom_process_input_func)]
    out += [f"      {k:<14}{v}" for k, v in items if v]
    engine = " ".join(f"{f.name}={_fmt(getattr(a, f.name))}" for f in fields(a)
                      if f.name not in _TABLE_ENGINE_FIELDS and getattr(a, f.name) is not None)
    out.append(f"      {'engine_args':<14}{engine}")
    if s.runtime.num_replicas != 1 or s.runtime.env:
        env = " ".join(f"{k}={v}" for k, v in s.runtime.env)
        out.append(f"      {'runtime':<14}num_replicas={s.runtime.num_replicas}" + (f" env: {env}" if env else ""))
    out.append(f"      {'sampling':<14}{_sampling(s.default_sampling_params)}")
    return out


def _sampling(sp: SamplingParams | DiffusionSamplingParams) -> str:
    if isinstance(sp, DiffusionSamplingParams):
        return " ".join(f"{k}={_fmt(v)}" for k, v in sp.to_dict().items() if v is not None)
    base = SamplingParams()
    shown = [n for n in _ALWAYS_SHOWN_SAMPLING] + [
        f.name for f in fields(sp) if not f.name.startswith("_") and f.name not in _ALWAYS_SHOWN_SAMPLING
        and getattr(sp, f.name) != getattr(base, f.name)]
    return " ".join(f"{n}={_fmt(getattr(sp, n))}" for n in shown)


def _fmt(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(getattr(v, "value", v))
