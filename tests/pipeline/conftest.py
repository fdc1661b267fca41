"""Fixtures for pipeline tests: a toy three-stage pipeline of tiny checkpoints, and the
same three models run by hand in this process (the reference the pipeline must match)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

TOY_YAML = """
stage_args:
  - stage_id: 0
    runtime: {{process: true, devices: "0", max_batch_size: 16}}
    engine_args: {{model: "{thinker}", model_stage: thinker, worker_type: ar, engine_output_type: latent,
                  max_model_len: {max_model_len}}}
    is_comprehension: true
    final_output: true
    final_output_type: text
    default_sampling_params: {{temperature: 0.0, max_tokens: 8, repetition_penalty: 1.0}}
  - stage_id: 1
    runtime: {{process: true, max_batch_size: 16}}
    engine_args: {{model: "{talker}", model_stage: talker, worker_type: ar, engine_output_type: text,
                  max_model_len: {max_model_len}}}
    engine_input_source: [0]
    custom_process_input_func: vllm_omni.testing.toy_stages.latent_to_prompt_embeds
    is_comprehension: false
    final_output: false
    default_sampling_params: {{temperature: 0.0, max_tokens: 6, repetition_penalty: 1.0}}
  - stage_id: 2
    runtime: {{process: true, max_batch_size: 4}}
    engine_args: {{model: "{talker}", model_stage: code2wav, worker_type: generation, engine_output_type: audio,
                  model_arch: vllm_omni.testing.toy_stages.ToyCode2Wav}}
    engine_input_source: [0, 1]
    custom_process_input_func: vllm_omni.testing.toy_stages.concat_source_tokens
    is_comprehension: false
    final_output: true
    final_output_type: audio
"""


@dataclass(frozen=True)
class ToyPipeline:
    thinker: Path
    talker: Path
    yaml: Path
    long_yaml: Path  # same stages with room for long generations (abort / kill tests)


@pytest.fixture(scope="session")
def toy_pipeline(tiny_model, tmp_path_factory) -> ToyPipeline:
    thinker, talker = tiny_model("qwen3", seed=0), tiny_model("qwen3", seed=1)
    out = tmp_path_factory.mktemp("toy-pipeline")
    paths = []
    for name, max_len in (("stages.yaml", 256), ("stages_long.yaml", 2048)):
        path = out / name
        path.write_text(TOY_YAML.format(thinker=thinker, talker=talker, max_model_len=max_len))
        paths.append(path)
    return ToyPipeline(thinker, talker, *paths)


@dataclass
class Reference:
    text_tokens: list[int]
    text: str
    hidden_last: torch.Tensor
    waveform: torch.Tensor


_ENGINES: dict[tuple, tuple] = {}


def run_reference(pipeline, prompts_ids: list[list[int]]) -> list[Reference]:
    """The three stage models driven by hand, one request at a time (solo runs)."""
    from vllm_omni.core.engine_config import EngineConfig
    from vllm_omni.core.llm_engine import LLMEngine
    from vllm_omni.engine.stage_input import StageView
    from vllm_omni.testing.toy_stages import ToyCode2Wav, concat_source_tokens, latent_to_prompt_embeds
    from vllm_omni.worker.gpu_ar_worker import engine_config_kwargs

    s0, s1, s2 = pipeline.stages
    key = tuple(repr(s) for s in pipeline.stages)
    if key not in _ENGINES:  # engines are reused across tests; every request runs alone anyway
        _ENGINES[key] = (LLMEngine(EngineConfig(**engine_config_kwargs(s0, "", "auto"))),
                         LLMEngine(EngineConfig(**engine_config_kwargs(s1, "", "auto"))))
    e0, e1 = _ENGINES[key]
    toy = ToyCode2Wav.load(s2.engine_args.model, model_stage=None, device=torch.device("cpu"), dtype="auto")
    refs = []
    for i, ids in enumerate(prompts_ids):
        out0 = _solo(e0, f"r{i}", ids, s0.default_sampling_params, return_hidden_states=True)
        (inp,) = latent_to_prompt_embeds([StageView(0, [out0])], [0])
        out1 = _solo(e1, f"r{i}", inp["prompt_token_ids"], s1.default_sampling_params,
                     prompt_embeds=inp["additional_information"]["prompt_embeds"])
        (joined,) = concat_source_tokens([StageView(0, [out0]), StageView(1, [out1])], [0, 1])
        comp = out0.outputs[0]
        refs.append(Reference(comp.token_ids, comp.text, comp.multimodal_output["last"],
                              toy.reference(joined["prompt_token_ids"])))
    return refs


def _solo(engine, request_id, ids, params, **kw):
    """The request's whole output (its deltas folded, as the orchestrator folds them)."""
    from vllm_omni.output_accumulator import OutputAccumulator

    assert engine.add_request(request_id, ids, params, **kw) is None
    acc = OutputAccumulator(request_id, None, ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            acc.add(out)
    assert acc.output.finished and acc.output.error is None
    return acc.output


def assert_matches(outputs, ref: Reference) -> None:
    """`outputs`: the two OmniRequestOutputs of one request (stage 0 text, stage 2 audio)."""
    by_stage = {o.stage_id: o for o in outputs}
    assert sorted(by_stage) == [0, 2], [(o.stage_id, o.error) for o in outputs]
    text = by_stage[0].request_output.outputs[0]
    assert by_stage[0].final_output_type == "text" and by_stage[2].final_output_type == "audio"
    assert text.token_ids == ref.text_tokens
    assert text.text == ref.text
    torch.testing.assert_close(text.multimodal_output["last"], ref.hidden_last, atol=1e-4, rtol=1e-4)
    # The waveform encodes stage 0's and stage 1's tokens exactly, so equality checks stage 1 too.
    assert torch.equal(by_stage[2].request_output.outputs[0].multimodal_output["waveform"], ref.waveform)


def pid_alive(pid: int) -> bool:
    """True while `pid` is a live (non-zombie) process; no psutil needed."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def random_prompts(n: int, seed: int, vocab: int = 400) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=gen).tolist()
    return [torch.randint(10, vocab, (n_tok,), generator=gen).tolist() for n_tok in lengths]

