"""vLLM engine args that upstream configs set and this engine honours: enable_chunked_prefill
(false: a prompt is prefilled in one step or waits), and dtype spellings (one vocabulary)."""
from __future__ import annotations

from vllm_omni.config import load_pipeline_config
from vllm_omni.core.block_manager import BlockManager
from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.llm_engine import LLMEngine
from vllm_omni.core.request import Request
from vllm_omni.core.scheduler import Scheduler, SchedulerConfig
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.worker.gpu_ar_worker import engine_config_kwargs


def first_step(chunked: bool) -> list[tuple[str, int]]:
    sched = Scheduler(SchedulerConfig(8, 16, 1024, enable_chunked_prefill=chunked), BlockManager(64, 4, False))
    for rid in ("a", "b"):
        sched.add_request(Request(rid, list(range(10)), SamplingParams()))
    return [(s.request.request_id, s.num_new_tokens) for s in sched.schedule().scheduled]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits_in():
    assert first_step(chunked=True) == [("a", 10), ("b", 6)]
    assert first_step(chunked=False) == [("a", 10)]


def test_the_yaml_flag_reaches_the_engine_and_is_kept(write_yaml, tiny_model):
    path = write_yaml("""\
        stage_args:
          - stage_id: 0
            engine_args: {enable_chunked_prefill: false, max_num_batched_tokens: 16, dtype: fp32}
        """)
    stage = load_pipeline_config(path).stage(0)
    kwargs = engine_config_kwargs(stage, str(tiny_model("qwen2")), "cpu")
    assert (kwargs["enable_chunked_prefill"], kwargs["dtype"]) == (False, "float32")
    engine = LLMEngine(EngineConfig(**kwargs))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    too_long = engine.add_request("long", list(range(1, 20)), params)
    assert too_long is not None and too_long.finished
    assert "more than one step's max_num_batched_tokens=16, and enable_chunked_prefill is off" in too_long.error
    assert engine.add_request("fits", list(range(1, 12)), params) is None
    done = [o for _ in range(10) for o in engine.step() if o.finished]
    assert [len(o.new_token_ids) for o in done] == [4]
