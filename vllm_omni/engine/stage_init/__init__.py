"""Implementation of the spec 002 stage init helpers, one module per responsibility.

Import them from ``vllm_omni.engine.stage_init_utils``, the documented module path.
"""
