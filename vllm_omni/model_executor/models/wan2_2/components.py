"""Loading a Wan2.2 diffusers folder into its components (models/diffusers_folder.py).

model_index.json holds the pipeline's own settings: `boundary_ratio` (two experts: the
high-noise `transformer` runs the steps whose timestep is >= boundary_ratio *
num_train_timesteps, `transformer_2` the others) and `expand_timesteps` (TI2V-5B: one timestep
per latent token, so an input image's frame can stay at timestep 0). `--boundary-ratio` and
`--flow-shift` override the folder's values.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_omni.model_executor.models.diffusers_folder import (component_class, load_component, load_scheduler,
                                                               read_index)

T2V_PIPELINE, I2V_PIPELINE = "WanPipeline", "WanImageToVideoPipeline"
PIPELINES = (T2V_PIPELINE, I2V_PIPELINE)
MASK_CHANNELS = 4  # the I2V-A14B condition's first-frame mask: one channel per frame of a latent frame


@dataclass
class WanComponents:
    pipeline_class: str
    transformers: tuple[Any, ...]  # diffusers WanTransformer3DModel: (transformer[, transformer_2])
    vae: Any  # diffusers AutoencoderKLWan
    text_encoder: Any  # transformers UMT5EncoderModel (None: not loaded, see load_components)
    tokenizer: Any
    scheduler: Any  # the folder's scheduler (flow_shift applied); each request schedules a copy
    boundary_ratio: float | None  # two experts: the switch point, as a fraction of num_train_timesteps
    expand_timesteps: bool  # TI2V-5B

    @property
    def z_dim(self) -> int:
        return self.vae.config.z_dim

    @property
    def takes_image(self) -> bool:
        """TI2V-5B takes an optional first frame; I2V-A14B needs one (its transformer reads the
        image's latents and mask as extra input channels)."""
        return self.expand_timesteps or self.needs_image

    @property
    def needs_image(self) -> bool:
        return self.transformers[0].config.in_channels == 2 * self.z_dim + MASK_CHANNELS


def load_components(model_dir: str | Path, *, device: torch.device, dtype: torch.dtype, dummy: bool = False,
                    boundary_ratio: float | None = None, flow_shift: float | None = None,
                    quantization: Any = None, text_encoder: bool = True,
                    transformer_device: torch.device | None = None) -> WanComponents:
    """`text_encoder=False`: a rank of a parallel stage that never encodes a prompt (rank 0
    prepares every request) leaves out the text encoder (UMT5-XXL in the released models).
    `transformer_device`: where the transformers load (default: `device`; layerwise offload: the CPU)."""
    model_dir = Path(model_dir)
    index = read_index(model_dir, PIPELINES, "Wan")
    names = ["transformer", "transformer_2"] if _present(index, "transformer_2") else ["transformer"]
    boundary = boundary_ratio if boundary_ratio is not None else index.get("boundary_ratio")
    _check_experts(model_dir, len(names), boundary, boundary_ratio)
    if quantization is not None and quantization.method == "gguf" and len(names) == 2:
        raise ValueError(f"{model_dir}: a GGUF file holds one transformer and this Wan2.2 model has two (A14B's "
                         "experts); GGUF runs Wan2.2 TI2V-5B")
    load = {name: load_component(model_dir, name, index[name], transformer_device or device, dtype, dummy, quantization)
            for name in names}
    load.update({name: load_component(model_dir, name, index[name], device, dtype, dummy, quantization)
                 for name in ("vae", *(("text_encoder",) if text_encoder else ()))})
    tokenizer = component_class(index["tokenizer"]).from_pretrained(model_dir / "tokenizer")
    scheduler = load_scheduler(model_dir, index["scheduler"], **_shift(index["scheduler"][1], flow_shift))
    components = WanComponents(index["_class_name"], tuple(load[n] for n in names), load["vae"],
                               load.get("text_encoder"), tokenizer, scheduler, boundary,
                               bool(index.get("expand_timesteps", False)))
    _check_supported(components)
    return components


def _present(index: dict[str, Any], name: str) -> bool:
    entry = index.get(name)
    return isinstance(entry, list) and entry[0] is not None


def _check_experts(model_dir: Path, experts: int, boundary: float | None, flag: float | None) -> None:
    if experts == 2 and boundary is None:
        raise ValueError(f"{model_dir} has two transformers but no boundary_ratio (model_index.json or "
                         "--boundary-ratio) saying where the low-noise one takes over")
    if experts == 1 and flag is not None:
        raise ValueError(f"--boundary-ratio {flag}: {model_dir} has one transformer (a boundary ratio switches "
                         "between two: Wan2.2 A14B)")


def _shift(scheduler_class: str, flow_shift: float | None) -> dict[str, float]:
    """--flow-shift as the scheduler's own setting (UniPC: flow_shift; flow-match Euler: shift)."""
    if flow_shift is None:
        return {}
    return {"flow_shift" if scheduler_class == "UniPCMultistepScheduler" else "shift": flow_shift}


def _check_supported(c: WanComponents) -> None:
    for t in c.transformers:
        config = t.config
        if config.image_dim is not None or config.added_kv_proj_dim is not None:
            raise ValueError("Wan transformers with CLIP image embeddings (Wan2.1 I2V) are not supported by the "
                             "native engine; use --diffusion-load-format diffusers")
        if tuple(config.patch_size)[0] != 1:
            raise ValueError(f"Wan transformer patch_size {tuple(config.patch_size)}: only 1 frame per patch is "
                             "supported")
    channels = c.transformers[0].config.in_channels
    if channels not in (c.z_dim, 2 * c.z_dim + MASK_CHANNELS):
        raise ValueError(f"Wan transformer in_channels={channels} fits neither text to video ({c.z_dim}, the VAE's "
                         f"z_dim) nor image to video ({2 * c.z_dim + MASK_CHANNELS})")
    if c.pipeline_class == I2V_PIPELINE and not c.takes_image:
        raise ValueError(f"{I2V_PIPELINE} with a text-to-video transformer (in_channels={channels})")
