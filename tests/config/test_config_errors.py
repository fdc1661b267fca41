"""Broken configs: each error names the file, the stage, the field, the bad value and
what is allowed, and every graph error is caught before anything starts."""
import textwrap

import pytest

from vllm_omni.config import ConfigError, load_pipeline_config
from vllm_omni.config.bundled import DEPLOY_DIR

TWO_STAGES = """\
stage_args:
  - stage_id: 0
    final_output: false
  - stage_id: 1
    engine_input_source: [0]
"""

LEGACY_CASES = {
    "unknown engine arg": ("""\
        stage_args:
          - stage_id: 0
            engine_args:
              gpu_memory_utilisation: 0.5
        """, ["stage 0", "engine_args", "unknown key 'gpu_memory_utilisation'",
              "did you mean 'gpu_memory_utilization'", "allowed:"]),
    "unknown stage key": ("""\
        stage_args:
          - stage_id: 0
            final_outputs: true
        """, ["stage 0", "unknown key 'final_outputs'", "did you mean 'final_output'"]),
    "engine arg outside engine_args": ("""\
        stage_args:
          - stage_id: 0
            gpu_memory_utilization: 0.5
        """, ["stage 0: gpu_memory_utilization: belongs in the 'engine_args:' section"]),
    "unknown top-level key": ("stage_arg: []\nstage_args:\n  - stage_id: 0\n",
                              ["unknown key 'stage_arg'", "allowed: async_chunk, connectors, runtime, stage_args"]),
    "bad type": ("""\
        stage_args:
          - stage_id: 0
            engine_args: {enforce_eager: "yes"}
        """, ["stage 0", "engine_args.enforce_eager='yes'", "allowed: true or false"]),
    "int where bool": ("""\
        stage_args:
          - stage_id: 0
            runtime: {max_batch_size: true}
        """, ["runtime.max_batch_size=True", "an integer >= 1"]),
    "bad value": ("""\
        stage_args:
          - stage_id: 0
            engine_args: {gpu_memory_utilization: 1.5}
        """, ["stage 0", "engine_args.gpu_memory_utilization=1.5", "a number in (0, 1]"]),
    "bad enum": ("""\
        stage_args:
          - stage_id: 0
            engine_args: {worker_type: autoregressive}
        """, ["worker_type='autoregressive'", "'ar' | 'generation' | 'diffusion'"]),
    "bad final_output_type": ("""\
        stage_args:
          - stage_id: 0
            final_output_type: speech
        """, ["final_output_type='speech'", "'text' | 'audio' | 'image' | 'video'"]),
    "bad devices": ("""\
        stage_args:
          - stage_id: 0
            runtime: {devices: "cuda:0"}
        """, ["runtime.devices='cuda:0'", 'e.g. "0" or "0,1"']),
    "devices vs tensor parallel": ("""\
        stage_args:
          - stage_id: 0
            runtime: {devices: "0"}
            engine_args: {tensor_parallel_size: 2}
        """, ["stage 0", "runtime.devices='0'", "lists 1 device(s) but tensor_parallel_size=2"]),
    "duplicate stage id": ("""\
        stage_args:
          - stage_id: 0
          - stage_id: 0
        """, ["duplicate stage_id 0 (stage_args[0] and stage_args[1])"]),
    "missing stage id": ("stage_args:\n  - runtime: {devices: '0'}\n", ["stage_args[0]", "missing required key 'stage_id'"]),
    "stage ids with a gap": ("""\
        stage_args:
          - stage_id: 0
          - stage_id: 2
            engine_input_source: [0]
        """, ["stage ids [0, 2] are not numbered 0..1", "without gaps"]),
    "unknown source": ("""\
        stage_args:
          - stage_id: 0
          - stage_id: 1
            engine_input_source: [5]
        """, ["stage 1", "engine_input_source=[5]", "stage 5 does not exist", "ids of other stages: 0, 1"]),
    "stage 0 takes input": ("""\
        stage_args:
          - stage_id: 0
            engine_input_source: [1]
          - stage_id: 1
        """, ["stage 0", "engine_input_source=[1]", "stage 0 receives the requests"]),
    "unreachable stage": ("""\
        stage_args:
          - stage_id: 0
          - stage_id: 1
        """, ["stage 1", "engine_input_source=[]", "no request would reach it"]),
    "self loop": ("""\
        stage_args:
          - stage_id: 0
            engine_input_source: [0]
        """, ["stage 0", "cannot take input from itself"]),
    "cycle": ("""\
        stage_args:
          - stage_id: 0
          - stage_id: 1
            engine_input_source: [0, 2]
          - stage_id: 2
            engine_input_source: [1]
        """, ["engine_input_source forms a cycle", "1 -> 2 -> 1", "an acyclic stage graph"]),
    "no final output": ("""\
        stage_args:
          - stage_id: 0
            final_output: false
        """, ["no stage has final_output: true", "at least one stage"]),
    "bad dotted name": ("""\
        stage_args:
          - stage_id: 0
            engine_args: {scheduler_cls: "my scheduler"}
        """, ["engine_args.scheduler_cls='my scheduler'", "a dotted Python path"]),
    "bad sampling value": ("""\
        stage_args:
          - stage_id: 0
            default_sampling_params: {top_p: 0}
        """, ["stage 0", "default_sampling_params.top_p=0", "in (0, 1]"]),
    "bad sampling type": ("""\
        stage_args:
          - stage_id: 0
            default_sampling_params: {temperature: hot}
        """, ["default_sampling_params.temperature='hot'", "float"]),
    "unknown sampling key": ("""\
        stage_args:
          - stage_id: 0
            default_sampling_params: {temprature: 0.5}
        """, ["unknown key 'temprature'", "did you mean 'temperature'"]),
    "inconsistent sampling": ("""\
        stage_args:
          - stage_id: 0
            default_sampling_params: {min_tokens: 5000}
        """, ["stage 0", "default_sampling_params are inconsistent", "min_tokens"]),
    "rejected vLLM engine arg": ("""\
        stage_args:
          - stage_id: 0
            engine_args: {quantization: fp8}
        """, ["engine_args.quantization", "does not implement", "not supported"]),
    "worker class of the other type": ("""\
        stage_args:
          - stage_id: 0
            engine_args:
              worker_type: ar
              worker_cls: vllm_omni.worker.gpu_generation_worker.GPUGenerationWorker
        """, ["engine_args.worker_cls=", "is a 'generation' class but the stage's worker_type is 'ar'"]),
    "edge without input": (TWO_STAGES + "runtime:\n  edges:\n    - {from: 1, to: 0}\n",
                           ["runtime.edges[0]", "edge 1 -> 0 has no matching engine_input_source"]),
    "bad window": (TWO_STAGES + "runtime:\n  defaults: {window_size: 0}\n",
                   ["runtime.defaults.window_size=0", "an integer >= 1 or -1"]),
    "unknown connector": (TWO_STAGES.replace("engine_input_source: [0]",
                                             "engine_input_source: [0]\n    input_connectors: {from_stage_0: shm}"),
                          ["stage 1", "input_connectors.from_stage_0='shm'", "unknown connector",
                           "(none defined)"]),
    "connector on a missing edge": ("""\
        connectors: {shm: {name: SharedMemoryConnector}}
        stage_args:
          - stage_id: 0
            output_connectors: {to_stage_1: shm}
        """, ["output_connectors.to_stage_1", "stage 1 takes no input from stage 0"]),
    "unknown connector class": ("connectors: {c: {name: TcpMagic}}\nstage_args:\n  - stage_id: 0\n",
                                ["connectors.c.name='TcpMagic'", "SharedMemoryConnector"]),
    "duplicate YAML key": ("""\
        stage_args:
          - stage_id: 0
            engine_args:
              enforce_eager: true
              enforce_eager: false
        """, ["invalid YAML", "duplicate key 'enforce_eager'"]),
    "YAML syntax": ("stage_args:\n  - stage_id: 0\n   bad: [\n", ["stages.yaml:", "invalid YAML"]),
    "not a mapping": ("- stage_id: 0\n", ["must hold a mapping at the top level"]),
    "unknown format": ("model: foo\n", ["cannot tell the config format", "stage_args"]),
}


@pytest.mark.parametrize("name", sorted(LEGACY_CASES))
def test_broken_legacy_config(name, write_yaml):
    text, expected = LEGACY_CASES[name]
    path = write_yaml(textwrap.dedent(text))
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path)
    message = str(info.value)
    assert str(path) in message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


DEPLOY_CASES = {
    "topology key in deploy": ("pipeline: qwen2_5_omni\nstages:\n  - stage_id: 1\n    model_stage: x\n",
                               ["stage 1", "model_stage", "part of the pipeline topology"]),
    "topology key in a nested deploy section": (
        "pipeline: qwen2_5_omni\nstages:\n  - stage_id: 1\n    engine_args: {model_arch: X}\n",
        ["stage 1", "engine_args.model_arch", "part of the pipeline topology"]),
    "stage not in the pipeline": ("pipeline: qwen2_5_omni\nstages:\n  - stage_id: 7\n    max_num_seqs: 1\n",
                                  ["stage 7", "the pipeline has no stage 7", "stage ids 0, 1, 2"]),
    "unknown platform": ("pipeline: qwen2_5_omni\nplatforms:\n  cdua: {stages: []}\n",
                         ["platforms", "unknown key 'cdua'", "did you mean 'cuda'", "cpu, cuda, hpu"]),
    "bad value in the current platform's delta": ("""\
        pipeline: qwen2_5_omni
        platforms:
          cuda:
            stages:
              - stage_id: 0
                max_num_seqs: 0
        """, ["(platforms.cuda)", "stage 0", "max_num_seqs=0", "an integer >= 1"]),
    "another platform's delta of the wrong shape": ("""\
        pipeline: qwen2_5_omni
        platforms:
          npu:
            stages: {stage_id: 0}
        """, ["(platforms.npu)", "platforms.npu.stages", "must be a list of stage entries"]),
    "unknown pipeline": ("pipeline: qwen9\nstages:\n  - stage_id: 0\n",
                         ["pipeline='qwen9'", "qwen2_5_omni | qwen2_5_omni_single_gpu | qwen2_5_omni_thinker_only "
                                              "| qwen3_omni_moe"]),
    "no pipeline and no model": ("stages:\n  - stage_id: 0\n    max_num_seqs: 2\n",
                                 ["needs a pipeline", "pass --model"]),
    "missing base": ("base_config: nowhere.yaml\n", ["base_config='nowhere.yaml'", "file not found"]),
    "unknown deploy key": ("pipeline: qwen2_5_omni\nstage: []\n",
                           ["unknown key 'stage'", "did you mean 'stages'"]),
}


@pytest.mark.parametrize("name", sorted(DEPLOY_CASES))
def test_broken_deploy_config(name, write_yaml):
    text, expected = DEPLOY_CASES[name]
    path = write_yaml(textwrap.dedent(text), "deploy.yaml")
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path)
    message = str(info.value)
    assert "deploy.yaml" in message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_sampling_values_combine_across_layers(write_yaml):
    path = write_yaml("stage_args:\n  - stage_id: 0\n    default_sampling_params: {max_tokens: 8000}\n")
    p = load_pipeline_config(path, stage_overrides={"0": {"default_sampling_params": {"min_tokens": 5000}}})
    assert (p.stage(0).default_sampling_params.min_tokens, p.stage(0).default_sampling_params.max_tokens) == \
        (5000, 8000)
    with pytest.raises(ConfigError, match=r"stages.yaml, --stage-overrides: stage 0: default_sampling_params "
                                          r"are inconsistent: .*min_tokens"):
        load_pipeline_config(path, stage_overrides={"0": {"default_sampling_params": {"min_tokens": 9000}}})


def test_base_config_cycle(write_yaml):
    write_yaml("base_config: b.yaml\npipeline: qwen2_5_omni\n", "a.yaml")
    path = write_yaml("base_config: a.yaml\n", "b.yaml")
    with pytest.raises(ConfigError, match="base_config forms a cycle"):
        load_pipeline_config(path)


def test_base_config_must_be_a_deploy_config(write_yaml):
    write_yaml("stage_args:\n  - stage_id: 0\n", "legacy.yaml")
    with pytest.raises(ConfigError, match="legacy stage_args config, not a deploy config"):
        load_pipeline_config(write_yaml("base_config: legacy.yaml\n", "overlay.yaml"))


@pytest.mark.parametrize("overrides, expected", [
    ("{not json", ["--stage-overrides", "invalid JSON at character 1"]),
    ("[1, 2]", ["--stage-overrides", "must be a JSON object keyed by stage id"]),
    ('{"first": {"max_num_seqs": 2}}', ["key 'first' is not a stage id"]),
    ('{"0": {"max_num_sequences": 2}}', ["--stage-overrides: stage 0", "unknown key 'max_num_sequences'",
                                         "did you mean 'max_num_seqs'"]),
    ('{"1": {"gpu_memory_utilization": 0}}', ["--stage-overrides: stage 1", "gpu_memory_utilization=0",
                                              "(0, 1]"]),
    ('{"9": {"max_num_seqs": 2}}', ["--stage-overrides: stage 9", "the pipeline has no stage 9"]),
    ('{"0": {"stage_id": 3}}', ["stage_id cannot be overridden"]),
    ('{"1": {"engine_input_source": [7]}}', ["--stage-overrides: stage 1", "engine_input_source=[7]",
                                             "stage 7 does not exist"]),
    ('{"1": {"engine_input_source": [2]}}', ["--stage-overrides: engine_input_source forms a cycle",
                                             "stage 1 -> 2 -> 1"]),
])
def test_broken_stage_overrides(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(DEPLOY_DIR / "qwen2_5_omni.yaml", stage_overrides=overrides)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_unknown_cli_flag():
    with pytest.raises(ConfigError, match=r"CLI flags: cannot be applied to stages: --port"):
        load_pipeline_config(DEPLOY_DIR / "qwen2_5_omni.yaml", cli_args={"port": 8000})


def test_missing_file():
    with pytest.raises(ConfigError, match="nope.yaml: file not found"):
        load_pipeline_config("nope.yaml")
