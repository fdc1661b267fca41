"""Loading a Qwen-Image diffusers folder into its components, as diffusers' from_pretrained does.

Each component is the class model_index.json names (library, class), loaded from its
subfolder; `dummy` builds the same classes from their configs with random weights, directly
on the device in the target dtype (benchmarks of the real architecture need no checkpoint).
"""
from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EDIT_PIPELINE = "QwenImageEditPipeline"
PIPELINES = ("QwenImagePipeline", EDIT_PIPELINE)


@dataclass
class QwenImageComponents:
    pipeline_class: str
    transformer: Any  # diffusers QwenImageTransformer2DModel
    vae: Any  # diffusers AutoencoderKLQwenImage
    text_encoder: Any  # transformers Qwen2_5_VLForConditionalGeneration
    tokenizer: Any
    scheduler_config: dict[str, Any]  # FlowMatchEulerDiscreteScheduler's
    image_processor: Any | None  # Qwen2-VL's image processor (edit pipeline)

    @property
    def is_edit(self) -> bool:
        return self.pipeline_class == EDIT_PIPELINE


def read_index(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "model_index.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} is not a diffusers pipeline folder (no model_index.json)")
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("_class_name") not in PIPELINES:
        raise ValueError(f"{model_dir}: pipeline {index.get('_class_name')!r} is not Qwen-Image; expected one of "
                         f"{PIPELINES} (other pipelines run with --diffusion-load-format diffusers)")
    return index


def load_components(model_dir: str | Path, *, device: torch.device, dtype: torch.dtype,
                    dummy: bool = False, transformer_device: torch.device | None = None) -> QwenImageComponents:
    """`transformer_device`: where the transformer loads (default: `device`)."""
    model_dir = Path(model_dir)
    index = read_index(model_dir)
    where = {"transformer": transformer_device or device, "vae": device, "text_encoder": device}
    models = {name: (_build if dummy else _load)(model_dir, name, index[name], where[name], dtype)
              for name in ("transformer", "vae", "text_encoder")}
    tokenizer = _component_class(index["tokenizer"]).from_pretrained(model_dir / "tokenizer")
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler_config = dict(FlowMatchEulerDiscreteScheduler.load_config(model_dir / "scheduler"))
    image_processor = None
    if index["_class_name"] == EDIT_PIPELINE:
        # The PIL flavour of Qwen2-VL's image processor: the default one needs torchvision.
        from transformers import Qwen2VLImageProcessorPil

        image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir / "processor")
    return QwenImageComponents(index["_class_name"], models["transformer"], models["vae"], models["text_encoder"],
                               tokenizer, scheduler_config, image_processor)


def _component_class(entry: list[str]) -> type:
    library, class_name = entry
    return getattr(importlib.import_module(library), class_name)


def _load(model_dir: Path, name: str, entry: list[str], device: torch.device, dtype: torch.dtype) -> Any:
    return _component_class(entry).from_pretrained(model_dir / name, dtype=dtype).to(device).eval()


def _build(model_dir: Path, name: str, entry: list[str], device: torch.device, dtype: torch.dtype) -> Any:
    cls = _component_class(entry)
    with torch.device(device), _default_dtype(dtype):
        if entry[0] == "diffusers":
            model = cls.from_config(cls.load_config(model_dir / name))
        else:
            from transformers import AutoConfig

            model = cls._from_config(AutoConfig.from_pretrained(model_dir / name), dtype=dtype)
    return model.to(dtype).eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created in the target dtype: a 20B transformer never exists in float32.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
