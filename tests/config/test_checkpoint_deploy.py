"""A checkpoint's own deploy settings (`vllm_omni_deploy.yaml` in the model folder): over the bundled
config when no config file is given, for the stages the chosen variant has, never choosing a
pipeline of its own (config/checkpoint_deploy.py)."""
from __future__ import annotations

import json

import pytest

from vllm_omni.config import ConfigError, load_pipeline_config
from vllm_omni.config.bundled import DEPLOY_DIR
from vllm_omni.config.checkpoint_deploy import CHECKPOINT_DEPLOY_FILE

OWN = """\
stages:
  - stage_id: 0
    max_tokens_limit: 64
    default_sampling_params: {max_tokens: 7}
  - stage_id: 1
    default_sampling_params: {max_tokens: 99}
"""


def checkpoint(tmp_path, hf_config: dict, own: str | None = OWN):
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    if own is not None:
        (tmp_path / CHECKPOINT_DEPLOY_FILE).write_text(own)
    return tmp_path


OMNI = {"model_type": "qwen2_5_omni", "architectures": ["Qwen2_5OmniForConditionalGeneration"]}


def limits(pipeline) -> list[tuple[int, int | None, int | None]]:
    return [(s.stage_id, s.default_sampling_params.max_tokens, s.max_tokens_limit) for s in pipeline.stages]


def test_the_checkpoint_settings_overlay_the_bundled_pipeline(tmp_path):
    model = checkpoint(tmp_path, OMNI)
    assert limits(load_pipeline_config(model=str(model), platform="cpu")) == [(0, 7, 64), (1, 99, None),
                                                                                (2, 2048, None)]
    # The text-only variant has no talker: the talker's entry is left out, the thinker's applies.
    assert limits(load_pipeline_config(model=str(model), platform="cpu", output_modalities=["text"])) == [(0, 7, 64)]
    # CLI-level overrides still win.
    over = load_pipeline_config(model=str(model), platform="cpu",
                                stage_overrides={"0": {"default_sampling_params": {"max_tokens": 5}}})
    assert limits(over)[0] == (0, 5, 64)


def test_a_config_file_replaces_them(tmp_path):
    model = checkpoint(tmp_path, OMNI)
    pipeline = load_pipeline_config(DEPLOY_DIR / "qwen2_5_omni.yaml", model=str(model), platform="cpu")
    assert limits(pipeline)[0] == (0, 2048, None)


def test_without_the_file_nothing_changes(tmp_path):
    model = checkpoint(tmp_path, OMNI, own=None)
    assert limits(load_pipeline_config(model=str(model), platform="cpu"))[0] == (0, 2048, None)


def test_a_plain_lm_takes_them_too(tmp_path):
    model = checkpoint(tmp_path, {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
                       own="stages:\n  - stage_id: 0\n    default_sampling_params: {max_tokens: 9}\n")
    assert limits(load_pipeline_config(model=str(model), platform="cpu")) == [(0, 9, None)]


@pytest.mark.parametrize("key", ["pipeline: qwen2_5_omni", "base_config: qwen2_5_omni.yaml"])
def test_it_cannot_choose_a_pipeline(tmp_path, key):
    model = checkpoint(tmp_path, OMNI, own=f"{key}\n{OWN}")
    with pytest.raises(ConfigError, match=CHECKPOINT_DEPLOY_FILE) as info:
        load_pipeline_config(model=str(model), platform="cpu")
    assert key.split(":")[0] in str(info.value)


def test_its_errors_name_the_file(tmp_path):
    model = checkpoint(tmp_path, OMNI, own="stages:\n  - stage_id: 0\n    max_tokenz: 3\n")
    with pytest.raises(ConfigError, match=CHECKPOINT_DEPLOY_FILE):
        load_pipeline_config(model=str(model), platform="cpu")
