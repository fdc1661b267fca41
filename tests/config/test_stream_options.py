"""A connector's chunk options (upstream's `codec_chunk_frames`, ...) reach the decoder stage on
its edges (StageConfig.stream_options), and options a stage cannot take are refused, by key
and stage, before any stage process starts (config/stream_options.py)."""
from __future__ import annotations

import pytest

from vllm_omni.config import ConfigError, load_pipeline_config, validate_dotted_names
from vllm_omni.config.bundled import DEPLOY_DIR

CODEC = {"initial_codec_chunk_frames", "codec_chunk_frames", "codec_left_context_frames"}


def overlay(write_yaml, base: str, extra: str, stage: int) -> object:
    """A deploy file on a bundled one whose connector `c` (with `extra`) feeds stage `stage`."""
    return load_pipeline_config(write_yaml(f"""\
        base_config: {base}
        connectors:
          c: {{name: SharedMemoryConnector, extra: {extra}}}
        stages:
          - stage_id: {stage}
            input_connectors: {{from_stage_{stage - 1}: c}}
        """, name="deploy.yaml"))


@pytest.mark.parametrize("name, decoder, initial", [
    ("qwen3_omni_moe.yaml", 2, 2), ("qwen3_omni_moe_single_gpu.yaml", 2, 2), ("qwen3_tts.yaml", 1, 1)])
def test_bundled_chunk_options_reach_code2wav_only(name, decoder, initial):
    p = load_pipeline_config(DEPLOY_DIR / name)
    for stage in p.stages:
        expected = {"initial_codec_chunk_frames": initial, "codec_chunk_frames": 25,
                    "codec_left_context_frames": 25} if stage.stage_id == decoder else {}
        assert dict(stage.stream_options) == expected, stage.stage_id
    assert not CODEC & {i.field.rsplit(".", 1)[-1] for i in p.ignored}  # no "ignored" warning for them
    validate_dotted_names(p)  # and the code2wav models take them


def test_user_deploy_file_sets_the_chunks(write_yaml):
    p = overlay(write_yaml, "qwen3_tts.yaml", "{initial_codec_chunk_frames: 1, codec_chunk_frames: 3}", 1)
    assert dict(p.stage(1).stream_options) == {"initial_codec_chunk_frames": 1, "codec_chunk_frames": 3}
    validate_dotted_names(p)


@pytest.mark.parametrize("extra, match", [
    ("{codec_chunk_frames: 0}", r"codec_chunk_frames=0: chunk sizes need 1 <= initial"),
    ("{codec_chunk_frames: -3}", r"codec_chunk_frames=-3"),
    ("{codec_left_context_frames: 0}", r"left_context_frames must be >= 1"),
    ("{initial_codec_chunk_frames: 30, codec_chunk_frames: 25}", r"initial \(30\) <= steady \(25\)"),
    ("{codec_chunk_frames: 2.5}", r"codec_chunk_frames must be an integer"),
    ("{codec_chunk_frame: 4}", r"does not read codec_chunk_frame; its options are initial_codec_chunk_frames"),
])
def test_bad_chunk_options_are_refused_by_stage_and_key(write_yaml, extra, match):
    p = overlay(write_yaml, "qwen3_tts.yaml", extra, 1)
    with pytest.raises(ConfigError, match=r"stage 1: connectors\.c\.extra: Qwen3TTSCode2Wav .*" + match):
        validate_dotted_names(p)


def test_qwen2_5_token2wav_takes_its_own_block_options_not_codec_frames(write_yaml):
    p = overlay(write_yaml, "qwen2_5_omni.yaml", "{chunk_blocks: 4, initial_chunk_blocks: 2}", 2)
    assert dict(p.stage(2).stream_options) == {"chunk_blocks": 4, "initial_chunk_blocks": 2}
    validate_dotted_names(p)
    p = overlay(write_yaml, "qwen2_5_omni.yaml", "{codec_chunk_frames: 25}", 2)
    with pytest.raises(ConfigError, match=r"stage 2: .*Qwen2_5OmniToken2Wav .*does not read codec_chunk_frames"):
        validate_dotted_names(p)


def test_chunk_options_on_the_thinker_to_talker_connector_reach_code2wav(write_yaml):
    """Upstream's Qwen3-Omni async-chunk config puts them there; the talker's chunks into code2wav
    are what they size, so code2wav (stage 2) reads them and the talker none."""
    p = overlay(write_yaml, "qwen3_omni_moe.yaml", "{initial_codec_chunk_frames: 2, codec_chunk_frames: 25}", 1)
    assert dict(p.stage(2).stream_options)["codec_chunk_frames"] == 25 and not p.stage(1).stream_options
    validate_dotted_names(p)


def test_chunk_options_that_reach_no_decoder_are_refused(write_yaml):
    with pytest.raises(ConfigError, match=r"connectors\.c\.extra\.codec_chunk_frames=25: is a chunk option of a "
                                          r"decoder \(generation\) stage, and connector 'c' reaches none: it is "
                                          r"on the input edges of stages 1"):
        load_pipeline_config(write_yaml("""\
            connectors:
              c: {name: SharedMemoryConnector, extra: {codec_chunk_frames: 25}}
            stage_args:
              - stage_id: 0
                final_output: false
              - stage_id: 1
                engine_input_source: [0]
                input_connectors: {from_stage_0: c}
            """))


def test_a_model_that_declares_no_options_gets_none(write_yaml, plugin_package):
    package = plugin_package({"plain_decoder": "class PlainDecoder:\n    pass\n"})
    p = load_pipeline_config(write_yaml("""\
        connectors:
          c: {name: SharedMemoryConnector, extra: {codec_chunk_frames: 5}}
        stage_args:
          - stage_id: 0
            final_output: false
          - stage_id: 1
            engine_input_source: [0]
            input_connectors: {from_stage_0: c}
            engine_args: {worker_type: generation, model_arch: %s.plain_decoder.PlainDecoder}
        """ % package))
    assert dict(p.stage(1).stream_options) == {"codec_chunk_frames": 5}
    with pytest.raises(ConfigError, match=r"stage 1: .*PlainDecoder .*takes no chunk options"):
        validate_dotted_names(p)


def test_two_input_connectors_must_agree(write_yaml):
    text = """\
        connectors:
          a: {name: SharedMemoryConnector, extra: {codec_chunk_frames: 5}}
          b: {name: SharedMemoryConnector, extra: {codec_chunk_frames: %d}}
        stage_args:
          - stage_id: 0
            final_output: false
          - stage_id: 1
            engine_input_source: [0]
            final_output: false
          - stage_id: 2
            engine_input_source: [0, 1]
            input_connectors: {from_stage_0: a, from_stage_1: b}
            engine_args: {worker_type: generation, model_arch: Qwen3OmniMoeForConditionalGeneration,
                          model_stage: code2wav}
        """
    assert dict(load_pipeline_config(write_yaml(text % 5)).stage(2).stream_options) == {"codec_chunk_frames": 5}
    with pytest.raises(ConfigError, match=r"stage 2: connectors\.b\.extra\.codec_chunk_frames=6: the connectors that "
                                          r"reach stage 2 disagree on it \(5 and 6\)"):
        load_pipeline_config(write_yaml(text % 6))
