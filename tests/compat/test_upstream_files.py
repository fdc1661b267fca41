"""Upstream vLLM-Omni's own 2026 stage-config, deploy and strategy files (our copies, laid out as in
upstream's tree: tests/compat/data/upstream) for our families and Wan2.2: each passes
`check-config` (parsed, its stage graph built, every dotted name and chunk option checked) or is
refused by name with the reason. docs/compatibility.md is the list; what the files exercise is
checked below them. Servers for a representative few: test_server_upstream_files.py.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllm_omni.config import ConfigError, load_pipeline_config, validate_dotted_names
from vllm_omni.model_executor.models import families
from vllm_omni.model_executor.models.family import ModelFamily

UPSTREAM = Path(__file__).parent / "data" / "upstream"
HF = {  # the HF config (as a dict) of each family's checkpoint: what --model contributes
    "qwen2_5_omni": {"model_type": "qwen2_5_omni", "architectures": ["Qwen2_5OmniForConditionalGeneration"]},
    "qwen3_omni": {"model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"]},
    "qwen3_tts": {"model_type": "qwen3_tts", "architectures": ["Qwen3TTSForConditionalGeneration"]},
    "qwen_image": {"architectures": ["QwenImagePipeline"]},
    "wan": {"architectures": ["WanPipeline"]},
}
OMNI = ["thinker", "talker", "code2wav"]
TTS = ["talker", "code2wav"]
# file -> the model stages it builds, or the refusal (a regex of the message: what and why)
NOT_HERE = "is not supported: stages exchange data as ZMQ messages"  # other connectors
EXPECTED: dict[str, list[str] | str] = {
    "benchmarks/diffusion/wan2_2_tp2.yaml": r"parallel_config\.tensor_parallel_size=2: tensor_parallel_size is "
                                            r"not supported: tensor parallelism of the diffusion transformer",
    "benchmarks/qwen3-tts/vllm_omni/configs/qwen3_tts_bs1.yaml": TTS,
    "benchmarks/qwen3-tts/vllm_omni/configs/qwen3_tts_bs16.yaml": TTS,
    "benchmarks/qwen3-tts/vllm_omni/configs/qwen3_tts_bs4.yaml": TTS,
    # a two-device pool for one engine: the layout its strategy file (below) completes
    "examples/offline_inference/qwen2_5_omni/deploy_qwen2_5_omni_replica.yaml": r"lists 2 device\(s\) but "
                                                                               r"tensor_parallel_size=1",
    "examples/offline_inference/qwen2_5_omni/deploy_qwen2_5_omni_tp2.yaml": r"lists 2 device\(s\) but "
                                                                           r"tensor_parallel_size=1",
    "examples/offline_inference/qwen2_5_omni/strategy_stage_replica.yaml": r"is upstream's parallel strategy file "
                                                                          r"\(`strategies:`\).*--strategy-config",
    "examples/offline_inference/qwen2_5_omni/strategy_tp2.yaml": r"is upstream's parallel strategy file",
    "examples/offline_inference/qwen3_omni/qwen3_omni_moe_tp.yaml": r"scheduler_cls 'vllm_omni\.core\.sched\.scheduler"
                                                                   r"\.OmniScheduler' is not supported",
    # FLASH_ATTN per role is ours; the self-attention's MXFP8 (an Ascend MindIE-SD kernel) is not
    "examples/offline_inference/text_to_video/wan22_quant_attention/fa_mxfp8.yaml": r"per_role\.self\.quant\.method: "
                                                                                   r"'mxfp8' is not supported \(MXFP8 "
                                                                                   r"attention is an Ascend MindIE-SD",
    "examples/online_serving/qwen3_omni/qwen3_omni_moe_thinking.yaml": ["thinker"],
    "tests/dfx/perf/deploy/qwen3_omni.yaml": OMNI,
    "tests/dfx/stability/deploy/qwen3_omni.yaml": OMNI,
    "tests/dfx/stability/stage_configs/qwen3_omni.yaml": OMNI,
    "tests/e2e/deploy/qwen3_omni_ci.yaml": OMNI,
    "tests/e2e/deploy/rocm/qwen3_omni_ci.yaml": OMNI,
    "tests/e2e/deploy/xpu/qwen3_omni_ci.yaml": OMNI,
    "tests/e2e/offline_inference/stage_configs/npu/qwen2_5_omni_ci.yaml": OMNI,
    "tests/e2e/offline_inference/stage_configs/rocm/qwen2_5_omni_ci.yaml": OMNI,
    "tests/e2e/offline_inference/stage_configs/rocm/qwen3_omni_ci.yaml": OMNI,
    "tests/e2e/online_serving/stage_configs/qwen3_omni_ci.yaml": OMNI,
    "tests/e2e/online_serving/stage_configs/qwen3_omni_thinker_ci.yaml": ["thinker"],
    "tests/e2e/online_serving/stage_configs/rocm/qwen3_omni_ci.yaml": OMNI,
    "tests/e2e/stage_configs/qwen2_5_omni_ci.yaml": OMNI,
    "tests/e2e/stage_configs/qwen2_5_omni_thinker_ci.yaml": ["thinker"],
    "tests/e2e/stage_configs/qwen3_omni_ci.yaml": OMNI,
    "tests/e2e/stage_configs/xpu/qwen2_5_omni_ci.yaml": OMNI,
    "tests/e2e/stage_configs/xpu/qwen3_omni_ci.yaml": OMNI,
    "tests/engine/deploy/qwen2_5_omni_thinker_ci.yaml": ["thinker"],
    "tests/multi_stages/stage_configs/qwen2_5_omni_ci.yaml": OMNI,
    "tests/multi_stages_h100/stage_configs/qwen3_omni_ci.yaml": OMNI,
    "tests/perf/stage_configs/qwen3_omni.yaml": OMNI,
    "tests/perf/stage_configs/qwen3_tts.yaml": TTS,
    "vllm_omni/deploy/ci/qwen2_5_omni.yaml": OMNI,
    "vllm_omni/deploy/ci/qwen3_omni_moe.yaml": OMNI,
    "vllm_omni/deploy/qwen2_5_omni.yaml": OMNI,
    "vllm_omni/deploy/qwen2_5_omni_multiconnector.yaml": r"MooncakeStoreConnector " + NOT_HERE,
    "vllm_omni/deploy/qwen3_omni_moe.yaml": OMNI,
    "vllm_omni/deploy/qwen3_omni_moe_multi_replicas.yaml": OMNI,
    "vllm_omni/deploy/qwen3_omni_moe_multiconnector.yaml": r"MooncakeStoreConnector " + NOT_HERE,
    "vllm_omni/deploy/qwen3_omni_moe_thinking.yaml": ["thinker"],
    "vllm_omni/deploy/qwen3_tts.yaml": TTS,
    "vllm_omni/deploy/qwen3_tts_batch.yaml": TTS,
    "vllm_omni/deploy/qwen3_tts_high_concurrency.yaml": TTS,
    "vllm_omni/deploy/qwen3_tts_no_async_chunk.yaml": TTS,
    "vllm_omni/deploy/qwen3_tts_forced_aligner.yaml": r"is upstream's forced-aligner settings file "
                                                      r"\(`forced_aligner:`, its --forced-aligner-config\): word "
                                                      r"timestamps with a forced aligner \(Qwen3-ForcedAligner\) "
                                                      r"are not supported",
    "vllm_omni/deploy/qwen_image.yaml": ["diffusion"],
    "vllm_omni/deploy/qwen_image_edit.yaml": ["diffusion"],
    "vllm_omni/deploy/qwen_image_edit_plus.yaml": ["diffusion"],
    "vllm_omni/deploy/qwen_image_layered.yaml": ["diffusion"],
    "vllm_omni/deploy/wan2_2.yaml": ["diffusion"],
    "vllm_omni/model_executor/stage_configs/npu/qwen2_5_omni.yaml": r"Ascend NPU worker classes are not supported",
    "vllm_omni/model_executor/stage_configs/npu/qwen3_omni_moe.yaml": r"Ascend NPU worker classes are not supported",
    "vllm_omni/model_executor/stage_configs/npu/qwen3_tts.yaml": r"Ascend NPU worker classes are not supported",
    "vllm_omni/model_executor/stage_configs/qwen2_5_omni.yaml": OMNI,
    "vllm_omni/model_executor/stage_configs/qwen2_5_omni_async_chunk.yaml": OMNI,
    "vllm_omni/model_executor/stage_configs/qwen2_5_omni_multiconnector.yaml": r"MooncakeStoreConnector " + NOT_HERE,
    "vllm_omni/model_executor/stage_configs/qwen3_omni_moe.yaml": OMNI,
    "vllm_omni/model_executor/stage_configs/qwen3_omni_moe_async_chunk.yaml": OMNI,
    "vllm_omni/model_executor/stage_configs/qwen3_omni_moe_multiconnector.yaml": r"MooncakeStoreConnector " + NOT_HERE,
    "vllm_omni/model_executor/stage_configs/qwen3_tts.yaml": TTS,
    "vllm_omni/model_executor/stage_configs/qwen3_tts_batch.yaml": TTS,
    "vllm_omni/model_executor/stage_configs/qwen3_tts_no_async_chunk.yaml": TTS,
    "vllm_omni/model_executor/stage_configs/qwen3_tts_uniproc.yaml": TTS,
    "vllm_omni/model_executor/stage_configs/qwen_image_dit_2gpu_fp8.yaml": r"tensor_parallel_size is not supported",
    "vllm_omni/model_executor/stage_configs/rocm/qwen2_5_omni.yaml": OMNI,
    "vllm_omni/model_executor/stage_configs/rocm/qwen3_omni_moe.yaml": OMNI,
    # the quantization is the checkpoint's (ModelOpt): such a checkpoint is refused when it loads
    "vllm_omni/model_executor/stage_configs/wan2_2_ti2v_dit_fp8.yaml": ["dit"],
    "vllm_omni/model_executor/stage_configs/wan2_2_ti2v_dit_nvfp4.yaml": ["dit"],
}


def family_of(name: str) -> str:
    for key, family in (("qwen2_5_omni", "qwen2_5_omni"), ("qwen3_omni", "qwen3_omni"), ("tts", "qwen3_tts"),
                        ("qwen_image", "qwen_image"), ("wan", "wan")):
        if key in name:
            return family
    raise AssertionError(f"no family for {name}")


def check(name: str, **kwargs):
    """What `vllm-omni check-config FILE --model M` does (in process): parse, build, import, check."""
    pipeline = load_pipeline_config(UPSTREAM / name, model=HF[family_of(name)], platform="cuda", **kwargs)
    validate_dotted_names(pipeline)
    return pipeline


def test_every_copied_file_has_an_expectation():
    assert sorted(str(p.relative_to(UPSTREAM)) for p in UPSTREAM.rglob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_file_passes_check_config_or_is_refused_by_name(name):
    expected = EXPECTED[name]
    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            check(name)
        return
    assert [s.model_stage for s in check(name).stages] == expected


def test_check_config_cli_reads_an_upstream_deploy_file(tmp_path):
    """The real command, on upstream's Qwen3-TTS deploy file (the subtalker settings, its connector
    extras) with a model folder that holds only config.json."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_tts", "architectures": '
                                          '["Qwen3TTSForConditionalGeneration"]}')
    out = subprocess.run([sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "check-config",
                          str(UPSTREAM / "vllm_omni/deploy/qwen3_tts.yaml"), "--model", str(tmp_path),
                          "--platform", "cuda"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "connector_get_sleep_s: stages here are event driven" in out.stdout
    assert out.stdout.rstrip().endswith("OK")


# --- what the files exercise --------------------------------------------------------------------

def test_qwen3_tts_deploy_file_subtalker_settings_and_connector_extras():
    p = check("vllm_omni/deploy/qwen3_tts.yaml")
    talker, code2wav = p.stages
    assert dict(talker.subtalker_sampling_params) == {"do_sample": True, "temperature": 0.9, "top_k": 50,
                                                      "top_p": 1.0}
    assert dict(code2wav.stream_options) == {"codec_chunk_frames": 25, "codec_left_context_frames": 72,
                                             "initial_codec_chunk_frames": 1}
    ignored = {i.field.rsplit(".", 1)[-1]: i.reason for i in p.ignored}
    for option in ("codec_streaming", "connector_get_sleep_s", "connector_get_max_wait",
                   "connector_get_max_wait_first_chunk", "decode_cudagraph_capture_sizes"):
        assert option in ignored, option
    assert "event driven" in ignored["connector_get_max_wait"]


@pytest.mark.parametrize("extra, match", [
    ("{codec_streaming: false}", r"codec_streaming: false is not supported"),
    ("{codec_left_context_frames: 72, ref_code_context_frames: 40}", r"ref_code_context_frames=40 is not supported: "
                                                                     r"a cloned voice's reference reaches the decoder"),
    ("{codec_chunk_ramp: [4, 8, 25]}", r"Code2WavStreamConfig does not read codec_chunk_ramp"),
])
def test_connector_extras_that_would_change_the_audio_are_refused_by_name(write_yaml, extra, match):
    path = write_yaml(f"""\
        base_config: qwen3_tts.yaml
        connectors:
          connector_of_shared_memory: {{name: SharedMemoryConnector, extra: {extra}}}
        """, name="deploy.yaml")
    with pytest.raises(ConfigError, match=match):
        validate_dotted_names(load_pipeline_config(path, model=HF["qwen3_tts"]))


def test_legacy_qwen3_tts_files_use_upstreams_stage_names():
    """`model_arch: Qwen3TTSTalkerForConditionalGeneration` / `Qwen3TTSCode2Wav`, `model_stage:
    qwen3_tts` and `tts_args` read through the family record (qwen3_tts/__init__.py)."""
    p = check("vllm_omni/model_executor/stage_configs/qwen3_tts.yaml")
    assert [(s.engine_args.model_arch, s.model_stage) for s in p.stages] == [
        ("Qwen3TTSForConditionalGeneration", "talker"), ("Qwen3TTSForConditionalGeneration", "code2wav")]
    assert p.stages[1].tts_max_instructions_length == 500 and p.async_chunk
    assert dict(p.stages[1].stream_options)["codec_left_context_frames"] == 72


def test_a_per_stage_architecture_its_model_stage_contradicts_is_refused(write_yaml):
    with pytest.raises(ConfigError, match=r"stage 0: engine_args\.model_stage='code2wav': "
                                          r"Qwen3TTSTalkerForConditionalGeneration is the 'talker' stage"):
        load_pipeline_config(write_yaml("""\
            stage_args:
              - stage_id: 0
                engine_args: {model_arch: Qwen3TTSTalkerForConditionalGeneration, model_stage: code2wav}
            """))


def test_qwen3_omni_async_chunk_options_on_the_thinker_connector_reach_code2wav():
    p = check("vllm_omni/model_executor/stage_configs/qwen3_omni_moe_async_chunk.yaml")
    assert p.async_chunk and not p.stages[1].stream_options
    assert dict(p.stages[2].stream_options) == {"codec_chunk_frames": 25, "codec_left_context_frames": 25}


def test_qwen2_5_omni_async_chunk_stream_turns_streaming_on():
    """Upstream v0.12's per-stage `async_chunk_stream: true` streams the pipeline; its
    `chunk_processor`s (and the bridges they replace there) are the family's stream bridges here."""
    p = check("vllm_omni/model_executor/stage_configs/qwen2_5_omni_async_chunk.yaml")
    assert p.async_chunk and p.stages[2].custom_process_input_func is None
    ignored = {i.field for i in p.ignored}
    assert {"engine_args.chunk_processor", "custom_process_input_func"} <= ignored


def test_a_users_own_chunk_processor_is_refused(write_yaml):
    with pytest.raises(ConfigError, match=r"chunk_processor is not supported: streaming edges use the model "
                                          r"family's stream bridges"):
        load_pipeline_config(write_yaml("""\
            stage_args:
              - stage_id: 0
                engine_args: {chunk_processor: my_pkg.MyChunkProcessor}
            """))


@pytest.mark.parametrize("checkpoint", [HF["qwen3_omni"], {**HF["qwen3_omni"], "enable_audio_output": False}])
def test_thinking_deploy_file_builds_one_thinker_stage(checkpoint):
    p = load_pipeline_config(UPSTREAM / "vllm_omni/deploy/qwen3_omni_moe_thinking.yaml", model=checkpoint,
                             platform="cuda")
    assert [s.model_stage for s in p.stages] == ["thinker"] and not p.async_chunk
    assert p.stages[0].engine_args.tensor_parallel_size == 2


def test_a_family_pipeline_named_for_a_thinking_checkpoint_is_its_thinker_alone(write_yaml):
    """Upstream's registry picks the topology from the HF config: a checkpoint without audio
    output runs the thinker alone whatever default pipeline the deploy file names."""
    path = write_yaml("pipeline: qwen3_omni_moe\nstages: [{stage_id: 0, max_num_seqs: 2}]\n", name="d.yaml")
    thinking = {**HF["qwen3_omni"], "enable_audio_output": False}
    assert [s.model_stage for s in load_pipeline_config(path, model=thinking).stages] == ["thinker"]
    assert [s.model_stage for s in load_pipeline_config(path, model=HF["qwen3_omni"]).stages] == OMNI


@pytest.mark.parametrize("deploy, strategy, replicas, tp, policy", [
    ("deploy_qwen2_5_omni_replica.yaml", "strategy_stage_replica.yaml", 2, 1, "round-robin"),
    ("deploy_qwen2_5_omni_tp2.yaml", "strategy_tp2.yaml", 1, 2, None),
])
def test_strategy_files_complete_their_deploy_files(deploy, strategy, replicas, tp, policy):
    folder = "examples/offline_inference/qwen2_5_omni/"
    p = check(folder + deploy, strategy_config=UPSTREAM / folder / strategy)
    thinker = p.stages[0]
    assert (thinker.runtime.num_replicas, thinker.engine_args.tensor_parallel_size, p.lb_policy) == (replicas, tp,
                                                                                                     policy)
    assert all(s.runtime.num_replicas == 1 and s.engine_args.tensor_parallel_size == 1 for s in p.stages[1:])


@pytest.mark.parametrize("axes, match", [
    ("[{axis: dp, size: 2}]", r"axis 'dp' is not supported: engine data parallelism is not supported"),
    ("[{axis: sp, size: 4}]", r"axis 'sp' is not supported"),
    ("[{axis: tp, size: 2, routing: round_robin}]", r"routing='round_robin': is a stage_replica axis' policy"),
    ("[{axis: stage_replica, size: 2, routing: hash}]", r"routing='hash'"),
])
def test_strategy_axes_this_engine_lacks_are_refused_by_name(write_yaml, axes, match):
    strategy = write_yaml(f"strategies:\n  thinker: {axes}\n", name="strategy.yaml")
    with pytest.raises(ConfigError, match=match):
        check("vllm_omni/deploy/qwen2_5_omni.yaml", strategy_config=strategy)


def test_a_strategy_for_a_stage_the_pipeline_lacks_is_refused(write_yaml):
    strategy = write_yaml("strategies:\n  vocoder: [{axis: tp, size: 2}]\n", name="strategy.yaml")
    with pytest.raises(ConfigError, match=r"strategies\.vocoder: names no stage of the pipeline; allowed: "
                                          r"code2wav, talker, thinker"):
        check("vllm_omni/deploy/qwen2_5_omni.yaml", strategy_config=strategy)


def test_a_file_of_no_known_format_is_named_by_its_keys(write_yaml):
    with pytest.raises(ConfigError, match=r"cannot tell the config format: top-level keys 'aligner', 'language'"):
        load_pipeline_config(write_yaml("aligner: {model: x}\nlanguage: en\n"))


def test_native_pipeline_classes_come_from_the_family_records(write_yaml, monkeypatch):
    """A diffusion stage may name a pipeline our engine has (the family records' diffusion
    architectures, Wan2.2's among them); another is refused until a family record lists it."""
    path = write_yaml("pipeline: qwen_image\nstages: [{stage_id: 0, model_class_name: Flux2Pipeline}]\n",
                      name="d.yaml")
    with pytest.raises(ConfigError, match=r"Flux2Pipeline is not supported: our diffusion engine has no such "
                                          r"pipeline; allowed: .*QwenImagePipeline.*Wan22Pipeline"):
        load_pipeline_config(path)
    flux = ModelFamily(name="flux2", architectures=("Flux2Pipeline",),
                       stage_models={"diffusion": "somewhere.model:FluxModel"})
    monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES, flux))
    assert load_pipeline_config(path).stages[0].engine_args.model_class_name == "Flux2Pipeline"
    diffusers = write_yaml("pipeline: qwen_image\nstages: [{stage_id: 0, model_class_name: WanPipeline, "
                           "diffusion_load_format: diffusers}]\n", name="e.yaml")
    assert load_pipeline_config(diffusers).stages[0].engine_args.model_class_name == "WanPipeline"


def test_subtalker_settings_on_a_stage_without_a_code_predictor_are_refused(write_yaml):
    path = write_yaml("stages: [{stage_id: 1, subtalker_sampling_params: {do_sample: false}}]\n", name="d.yaml")
    pipeline = load_pipeline_config(path, model=HF["qwen3_tts"])
    with pytest.raises(ConfigError, match=r"stage 1: subtalker_sampling_params: is not supported by Qwen3TTSCode2Wav"):
        validate_dotted_names(pipeline)
    with pytest.raises(ConfigError, match=r"subtalker_sampling_params=\{'top_k': 'many'\}"):
        load_pipeline_config(write_yaml("stages: [{stage_id: 0, subtalker_sampling_params: {top_k: many}}]\n",
                                        name="e.yaml"), model=HF["qwen3_tts"])


def test_a_forced_aligner_section_in_a_deploy_file_is_refused_by_name(write_yaml):
    path = write_yaml("base_config: qwen3_tts.yaml\nforced_aligner: {model: Qwen/Qwen3-ForcedAligner-0.6B}\n",
                      name="d.yaml")
    with pytest.raises(ConfigError, match=r"forced_aligner is not supported: word timestamps with a forced aligner"):
        load_pipeline_config(path, model=HF["qwen3_tts"])


def test_the_forced_aligner_flags_are_refused_by_name():
    from vllm_omni.entrypoints.cli import serve_args

    parser = __import__("argparse").ArgumentParser()
    serve_args.add_arguments(parser)
    args = parser.parse_args(["--forced-aligner-config", "aligner.yaml"])
    assert serve_args.refused_flags(args) == ["--forced-aligner-config='aligner.yaml' is not supported: word "
                                              "timestamps with a forced aligner are not supported"]


def test_tts_args_instructions_limit_reaches_the_server_under_its_flag():
    from vllm_omni.entrypoints.cli.serve import _tts_instructions_limit

    pipeline = check("vllm_omni/model_executor/stage_configs/qwen3_tts.yaml")
    assert _tts_instructions_limit(None, pipeline) == 500 and _tts_instructions_limit(40, pipeline) == 40
    assert _tts_instructions_limit(None, check("vllm_omni/deploy/qwen3_tts.yaml")) is None  # the server's default
