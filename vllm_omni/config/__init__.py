"""Stage-pipeline configuration: parsed and validated once, at the edge (DESIGN 6).

    from vllm_omni.config import load_pipeline_config
    pipeline = load_pipeline_config("my_stages.yaml", stage_overrides='{"1": {"max_num_seqs": 4}}')
    pipeline.stage(0).engine_args.gpu_memory_utilization
"""
from vllm_omni.config.bundled import find_bundled_config, pipeline_for_model, read_hf_config
from vllm_omni.config.errors import ConfigError
from vllm_omni.config.loader import (detect_platform, load_pipeline_config, load_stage_configs_from_yaml,
                                     single_stage_pipeline)
from vllm_omni.config.overrides import STAGE_CLI_FIELDS, parse_stage_overrides
from vllm_omni.config.render import describe_pipeline
from vllm_omni.config.resolve import DOCUMENTED_DOTTED_NAMES, resolve_dotted, validate_dotted_names
from vllm_omni.config.stage_config import (ConfigFormat, ConnectorConfig, EdgeConfig, EngineOutputType,
                                           FinalOutputType, PipelineConfig, PipelineRuntimeConfig,
                                           StageConfig, StageEngineArgs, StageRuntimeConfig, WorkerType)

__all__ = [
    "ConfigError", "ConfigFormat", "ConnectorConfig", "DOCUMENTED_DOTTED_NAMES", "EdgeConfig",
    "EngineOutputType", "FinalOutputType", "PipelineConfig", "PipelineRuntimeConfig",
    "STAGE_CLI_FIELDS", "StageConfig", "StageEngineArgs", "StageRuntimeConfig", "WorkerType",
    "describe_pipeline", "detect_platform", "find_bundled_config", "load_pipeline_config",
    "load_stage_configs_from_yaml", "parse_stage_overrides", "pipeline_for_model", "read_hf_config",
    "resolve_dotted", "single_stage_pipeline", "validate_dotted_names",
]
