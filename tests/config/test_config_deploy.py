"""Spec 001 deploy configs, base_config overlays, platform deltas, CLI flags and
--stage-overrides, with the precedence of DESIGN 6."""
import pytest

from vllm_omni.config import ConfigError, ConfigFormat, load_pipeline_config
from vllm_omni.config.bundled import DEPLOY_DIR

QWEN25 = {"model_type": "qwen2_5_omni", "architectures": ["Qwen2_5OmniModel"]}
QWEN3 = {"model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"]}


@pytest.mark.parametrize("name", ["qwen2_5_omni", "qwen2_5_omni_single_gpu", "qwen3_omni_moe"])
@pytest.mark.parametrize("platform", ["cuda", "rocm", "npu", "xpu", "cpu"])
def test_bundled_deploy_configs_parse(name, platform):
    p = load_pipeline_config(DEPLOY_DIR / f"{name}.yaml", platform=platform)
    assert p.format is ConfigFormat.DEPLOY and p.pipeline_name == name
    assert [s.engine_args.model_stage for s in p.stages] == ["thinker", "talker", "code2wav"]
    assert [s.final_output_type.value for s in p.final_stages] == ["text", "audio"]


def test_bundled_deploy_is_the_default_for_the_model():
    p = load_pipeline_config(model=QWEN25)
    assert p.format is ConfigFormat.DEPLOY and p.async_chunk is True  # bundled deploy files stream
    talker = p.stage(1)
    assert talker.engine_args.max_num_seqs == 3  # from the deploy file (= spec 000's max_batch_size)
    assert talker.default_sampling_params.stop_token_ids == [8294]  # kept from the pipeline
    assert talker.custom_process_input_func.endswith("qwen2_5_omni.thinker2talker")
    q3 = load_pipeline_config(model=QWEN3)
    assert q3.async_chunk is True and [e.connector for e in q3.edges] == ["connector_of_shared_memory"] * 2
    assert q3.stage(1).default_sampling_params.detokenize is False


@pytest.fixture
def upstream_example(write_yaml):
    """The worked override example of upstream's deploy docs."""
    write_yaml("""\
        pipeline: qwen3_omni_moe
        async_chunk: true
        stages:
          - stage_id: 0
            gpu_memory_utilization: 0.9
            max_num_seqs: 32
          - stage_id: 1
            gpu_memory_utilization: 0.7
            max_num_seqs: 16
        """, "base.yaml")
    return write_yaml("""\
        base_config: base.yaml
        stages:
          - stage_id: 1
            gpu_memory_utilization: 0.5
        """, "my_overrides.yaml")


def test_overlay_cli_and_stage_overrides_precedence(upstream_example):
    p = load_pipeline_config(upstream_example, cli_args={"max_model_len": 16384, "max_num_seqs": None},
                             stage_overrides='{"0": {"max_num_seqs": 8}}')
    s0, s1, s2 = p.stages
    assert (s0.engine_args.gpu_memory_utilization, s0.engine_args.max_num_seqs) == (0.9, 8)
    assert (s1.engine_args.gpu_memory_utilization, s1.engine_args.max_num_seqs) == (0.5, 16)
    assert s0.engine_args.max_model_len == s1.engine_args.max_model_len == 16384
    assert s2.engine_args.max_model_len == 16384
    assert s2.engine_args.gpu_memory_utilization == 0.1  # bundled pipeline default
    assert p.source.endswith("my_overrides.yaml")


def test_precedence_each_layer_beats_the_one_below(write_yaml):
    path = write_yaml("""\
        pipeline: qwen2_5_omni
        stages:
          - stage_id: 0
            gpu_memory_utilization: 0.5
        platforms:
          xpu:
            stages:
              - stage_id: 0
                gpu_memory_utilization: 0.6
        """)
    def gmu(**kw):
        return load_pipeline_config(path, **kw).stage(0).engine_args.gpu_memory_utilization
    assert load_pipeline_config(write_yaml("pipeline: qwen2_5_omni\n", "bare.yaml")).stage(0) \
        .engine_args.gpu_memory_utilization == 0.8  # bundled pipeline
    assert gmu() == 0.5  # user's YAML > bundled
    assert gmu(platform="xpu") == 0.6  # platform delta > user's YAML
    assert gmu(platform="xpu", cli_args={"gpu_memory_utilization": 0.7}) == 0.7  # CLI > platform
    assert gmu(platform="xpu", cli_args={"gpu_memory_utilization": 0.7},
               stage_overrides={"0": {"gpu_memory_utilization": 0.75}}) == 0.75  # overrides > CLI


def test_platform_delta_of_the_base_applies_over_the_overlay(write_yaml):
    path = write_yaml("""\
        base_config: qwen2_5_omni.yaml   # a bundled name: found in vllm_omni/deploy
        stages:
          - stage_id: 2
            devices: "1"
        """)
    assert load_pipeline_config(path).stage(2).runtime.devices == "1"
    assert load_pipeline_config(path, platform="rocm").stage(2).runtime.devices == "2"


def test_pipeline_wide_fields_and_async_chunk(write_yaml):
    path = write_yaml("""\
        pipeline: qwen2_5_omni
        dtype: bfloat16
        enable_prefix_caching: true
        stages:
          - stage_id: 2
            enable_prefix_caching: false
        """)
    p = load_pipeline_config(path)
    assert [s.engine_args.dtype for s in p.stages] == ["bfloat16"] * 3
    assert [s.engine_args.enable_prefix_caching for s in p.stages] == [True, True, False]
    assert p.async_chunk is True  # the deploy format's default
    assert load_pipeline_config(path, async_chunk=False).async_chunk is False


def test_cli_flags_for_one_stage(write_yaml):
    p = load_pipeline_config(DEPLOY_DIR / "qwen2_5_omni.yaml", cli_stage_id=1,
                             cli_args={"gpu-memory-utilization": 0.5})
    assert [s.engine_args.gpu_memory_utilization for s in p.stages] == [0.8, 0.5, 0.15]


def test_stage_overrides_nested_and_flat_spellings():
    p = load_pipeline_config(model=QWEN25, stage_overrides={
        0: {"engine_args": {"max_num_seqs": 2}, "runtime": {"devices": "1"}},
        "2": {"enforce_eager": False, "default_sampling_params": {"max_tokens": 100}}})
    assert p.stage(0).engine_args.max_num_seqs == 2 and p.stage(0).runtime.devices == "1"
    assert p.stage(2).engine_args.enforce_eager is False
    assert p.stage(2).default_sampling_params.max_tokens == 100
    assert p.stage(2).default_sampling_params.repetition_penalty == 1.1


def test_pipeline_given_as_a_stage_args_path(write_yaml):
    write_yaml("""\
        stage_args:
          - stage_id: 0
            engine_args: {model_stage: encoder}
            final_output: false
          - stage_id: 1
            engine_input_source: [0]
            engine_args: {model_stage: decoder, worker_type: generation}
            final_output_type: audio
        """, "topology/my_model.yaml")
    p = load_pipeline_config(write_yaml("""\
        pipeline: topology/my_model.yaml
        stages:
          - stage_id: 1
            max_num_seqs: 4
        """))
    assert [s.model_stage for s in p.stages] == ["encoder", "decoder"]
    assert p.stage(1).engine_args.max_num_seqs == 4 and p.pipeline_name is None


def test_deploy_for_a_plain_llm_uses_one_stage(write_yaml):
    p = load_pipeline_config(write_yaml("stages:\n  - stage_id: 0\n    max_num_seqs: 16\n"),
                             model={"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    assert p.num_stages == 1 and p.stage(0).engine_args.max_num_seqs == 16
    assert p.stage(0).engine_args.model_arch == "Qwen2ForCausalLM"


def test_expected_format_is_enforced(write_yaml):
    with pytest.raises(ConfigError, match="is a deploy config; pass it with --deploy-config"):
        load_pipeline_config(DEPLOY_DIR / "qwen2_5_omni.yaml", expected_format="legacy")
    legacy = write_yaml("stage_args:\n  - stage_id: 0\n")
    with pytest.raises(ConfigError, match="legacy stage_args config; pass it with --stage-configs-path"):
        load_pipeline_config(legacy, expected_format="deploy")


def test_upstream_only_engine_args_are_ignored_with_a_warning(write_yaml, caplog):
    # Keys from upstream's deploy files that do not change results on our engine.
    path = write_yaml("""\
        pipeline: qwen2_5_omni
        distributed_executor_backend: mp
        stages:
          - stage_id: 0
            mm_processor_cache_gb: 0
          - stage_id: 2
            enable_flashinfer_autotune: false
            async_scheduling: false
        """)
    p = load_pipeline_config(path)
    assert p.num_stages == 3
    assert {(i.field, i.stages) for i in p.ignored} == {
        ("distributed_executor_backend", ()), ("mm_processor_cache_gb", (0,)), ("enable_flashinfer_autotune", (2,)),
        ("async_scheduling", (2,))}
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1  # one warning per load, naming every ignored key
    for key in ("distributed_executor_backend", "mm_processor_cache_gb", "enable_flashinfer_autotune",
                "async_scheduling"):
        assert key in warnings[0].getMessage()
