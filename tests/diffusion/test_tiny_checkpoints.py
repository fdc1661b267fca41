"""`python -m vllm_omni.testing qwen_image DIR` / `qwen_image_edit DIR`: diffusers' own folder layout,
deterministic per seed."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_omni.testing import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_cli_builds_the_diffusers_layout_deterministically(tmp_path, qwen_image_dir):
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "vllm_omni.testing", "qwen_image", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert {k: v for k, v in index.items() if not k.startswith("_")} == {
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "QwenImageTransformer2DModel"], "vae": ["diffusers", "AutoencoderKLQwenImage"]}
    assert _digests(out) == _digests(qwen_image_dir)  # seed 0 in both: byte-identical
    other = make_tiny_model("qwen_image", tmp_path / "seed1", seed=1)
    changed = {k for k, v in _digests(other).items() if _digests(out)[k] != v}
    assert {"transformer/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
            "text_encoder/model.safetensors"} <= changed


def test_edit_checkpoint_and_overrides(qwen_image_edit_dir, tmp_path):
    from diffusers import QwenImageTransformer2DModel

    index = json.loads((qwen_image_edit_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline" and index["processor"] == ["transformers",
                                                                                      "Qwen2VLProcessor"]
    assert (qwen_image_edit_dir / "processor" / "preprocessor_config.json").is_file()
    assert (qwen_image_edit_dir / "processor" / "tokenizer.json").is_file()
    wider = make_tiny_model("qwen_image", tmp_path / "wide", transformer_num_layers=3, text_hidden_size=32)
    config = QwenImageTransformer2DModel.load_config(wider / "transformer")
    assert config["num_layers"] == 3 and config["joint_attention_dim"] == 32
    with pytest.raises(ValueError, match="unknown qwen_image override 'layers'"):
        make_tiny_model("qwen_image", tmp_path / "bad", layers=3)
