"""A checkpoint's own deploy settings: `vllm_omni_deploy.yaml` in the model folder.

As generation_config.json carries a model's own generation defaults, a checkpoint folder may
carry stage settings in the deploy format (`stages:`, `async_chunk`, `platforms:`, ...). They
overlay the bundled pipeline the model runs (whichever variant was chosen), so the file may not
name its own `pipeline:` or `base_config:`, and its entries for stages the chosen variant does
not have are left out (a text-only run has no talker to set). They apply only when no config
file is given, between the bundled deploy config and the CLI flags; a `--deploy-config` /
`--stage-configs-path` file replaces them. The embedded demo model uses this for its short default replies
(vllm_omni/testing/demo_model.py).
"""
from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

from vllm_omni.config.deploy import read_deploy_chain
from vllm_omni.config.errors import ConfigError
from vllm_omni.config.layers import Layer
from vllm_omni.config.yaml_io import load_yaml_file

CHECKPOINT_DEPLOY_FILE = "vllm_omni_deploy.yaml"
_NOT_ALLOWED = ("pipeline", "base_config")


def checkpoint_deploy_layers(model: object, platform: str, stage_ids: Collection[int]) -> list[Layer]:
    """The layers of `model`'s own deploy file ([] when it is not a local folder or has none),
    for the stages of the pipeline it runs (`stage_ids`)."""
    if not isinstance(model, (str, os.PathLike)):
        return []
    path = Path(model).expanduser() / CHECKPOINT_DEPLOY_FILE
    if not path.is_file():
        return []
    data = load_yaml_file(path)
    for key in _NOT_ALLOWED:
        if key in data:
            raise ConfigError("a checkpoint's own deploy settings overlay the bundled pipeline it runs and "
                              "cannot choose another", source=str(path), field=key, value=data[key],
                              allowed="stage settings only (pass --deploy-config to choose a pipeline)")
    layers = read_deploy_chain(path, data, platform=platform).layers
    for layer in layers:
        layer.stages = {sid: fields for sid, fields in layer.stages.items() if sid in stage_ids}
    return layers
