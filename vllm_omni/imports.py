"""Dotted-path imports: YAML `custom_process_input_func` / `worker_cls`, model family records."""
from __future__ import annotations

import importlib
from typing import Any


def import_dotted(path: str) -> Any:
    """Import ``"package.module.attr"`` (or ``"package.module:Class.attr"``) and return the attr.

    Errors name the path, so a typo in a YAML ``custom_process_input_func``
    is found from the message alone.
    """
    if not isinstance(path, str) or "." not in path.replace(":", "."):
        raise ValueError(f"dotted path {path!r} is invalid: must look like 'package.module.attr'")
    path = path.strip()
    module_name, attr_path = path.split(":", 1) if ":" in path else path.rsplit(".", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import {path!r}: module {module_name!r} failed to import: {e}") from e
    try:
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except AttributeError as e:
        raise ImportError(f"cannot import {path!r}: module {module_name!r} has no attribute {attr_path!r}") from e
    return obj
