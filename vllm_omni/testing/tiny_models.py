"""Deterministic tiny random-weight HF checkpoints for tests and demos (built offline).

    make_tiny_model("qwen3", "/tmp/m", seed=0, num_hidden_layers=3) -> Path("/tmp/m")

The folder holds what a real hub checkpoint holds: config.json, model.safetensors,
generation_config.json and the tokenizer files. Each tiny checkpoint name is one builder,
named by its model family's record (`ModelFamily.tiny_checkpoints`): `builder(out_dir,
overrides)` writes the whole folder (transformers models through `save_hf_checkpoint`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

import vllm_omni.envs as envs
from vllm_omni.testing.tokenizer import make_tiny_tokenizer

# A builder gets the output folder and the config overrides and writes the checkpoint there.
# The caller seeds torch just before calling it.
ArchBuilder = Callable[[Path, dict[str, Any]], None]

# Shared by all tiny text models. The default initializer_range (0.02) makes a tiny random
# model's greedy output collapse into one repeated token within a few steps, so tests that
# compare outputs would prove little. 0.5 keeps it diverse for dozens of tokens (measured over
# 8 seeds x 5 prompts x 40 tokens: it beat 0.3 and 0.7, mostly for qwen3_moe).
BASE_TEXT_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    initializer_range=0.5,
    dtype="float32",
)

# The embedded demo models, by arch: (tiny checkpoint, versioned folder name: a changed builder
# gets a new folder). Both are shaped to say words (the Omni demo also speaks them): demo_model.py.
DEMO_MODELS = {"qwen2_5_omni": ("qwen2_5_omni_demo", "demo-qwen2_5_omni-v3"), "qwen3": ("qwen3_demo", "demo-qwen3-v2")}
DEMO_ARCH = "qwen2_5_omni"  # what `vllm-omni generate` / `serve` run without a model


def tiny_checkpoint_builders() -> dict[str, str]:
    """Every tiny checkpoint name -> its builder's dotted path, from the family records."""
    from vllm_omni.model_executor.models.families import FAMILIES

    return {name: path for family in FAMILIES for name, path in family.tiny_checkpoints.items()}


def tiny_vocab_size(tokenizer: PreTrainedTokenizerBase) -> int:
    """Embedding rows: the tokenizer size rounded up to 64, like real checkpoints pad theirs."""
    return -(-len(tokenizer) // 64) * 64


def text_config_kwargs(tokenizer: PreTrainedTokenizerBase, **arch_defaults: Any) -> dict[str, Any]:
    """Config kwargs shared by the tiny text models, updated with per-arch defaults."""
    return dict(
        BASE_TEXT_CONFIG,
        vocab_size=tiny_vocab_size(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        **arch_defaults,
    )


def perturb_constant_params(model: PreTrainedModel, std: float = 0.2) -> None:
    """Add noise to parameters that HF initialises to a constant (norm weights 1, biases 0).

    Otherwise a loader that forgets to load them, or maps them to the wrong layer, would give
    the same outputs as a correct one and the tests would not notice.
    """
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                param.add_(torch.randn_like(param) * std)


def omni_preprocessor_config(
    processor_class: str, *, image_mean: list[float], image_std: list[float], patch_size: int
) -> dict[str, Any]:
    """A released Omni checkpoint's preprocessor_config.json: Whisper audio features (300 s max,
    128 mels at 16 kHz) + Qwen2-VL images; the generations differ only in the arguments."""
    return {
        "processor_class": processor_class,
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128,
        "sampling_rate": 16000,
        "hop_length": 160,
        "n_fft": 400,
        "chunk_length": 300,
        "n_samples": 4800000,
        "nb_max_frames": 30000,
        "dither": 0.0,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
        "image_processor_type": "Qwen2VLImageProcessor",
        "image_mean": image_mean,
        "image_std": image_std,
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": patch_size,
        "merge_size": 2,
        "temporal_patch_size": 2,
    }


def _build_causal_lm(model_cls: type, config_cls: type, kwargs: dict[str, Any]) -> PreTrainedModel:
    config = config_cls(**kwargs)
    model = model_cls(config)
    perturb_constant_params(model)
    # Weights are initialised in float32 whatever the config says; casting afterwards keeps a
    # bf16 checkpoint the exact rounding of the fp32 one with the same seed.
    dtype = config.dtype or torch.float32
    return model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype).eval()


def build_tiny_qwen2(out_dir: Path, overrides: dict[str, Any]) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = make_tiny_tokenizer()
    kwargs = text_config_kwargs(tokenizer, tie_word_embeddings=False)
    save_hf_checkpoint(_build_causal_lm(Qwen2ForCausalLM, Qwen2Config, {**kwargs, **overrides}), tokenizer, out_dir)


def build_tiny_qwen3(out_dir: Path, overrides: dict[str, Any]) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = make_tiny_tokenizer()
    # Tied by default (like the small real Qwen3 models) so loaders exercise both layouts.
    kwargs = text_config_kwargs(tokenizer, head_dim=16, tie_word_embeddings=True)
    save_hf_checkpoint(_build_causal_lm(Qwen3ForCausalLM, Qwen3Config, {**kwargs, **overrides}), tokenizer, out_dir)


def build_demo_qwen3(out_dir: Path, overrides: dict[str, Any]) -> None:
    """The embedded text demo: the tiny Qwen3 with its head apart from its embeddings (the two
    are edited differently), shaped to say whole words only (demo_model.py)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from vllm_omni.testing.demo_model import shape_text_demo_weights

    tokenizer = make_tiny_tokenizer()
    kwargs = text_config_kwargs(tokenizer, head_dim=16, tie_word_embeddings=False)
    model = _build_causal_lm(Qwen3ForCausalLM, Qwen3Config, {**kwargs, **overrides})
    shape_text_demo_weights(model, tokenizer)
    save_hf_checkpoint(model, tokenizer, out_dir)


def build_tiny_qwen3_moe(out_dir: Path, overrides: dict[str, Any]) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = make_tiny_tokenizer()
    kwargs = text_config_kwargs(
        tokenizer,
        head_dim=16,
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    model = _build_causal_lm(Qwen3MoeForCausalLM, Qwen3MoeConfig, {**kwargs, **overrides})
    save_hf_checkpoint(model, tokenizer, out_dir)


def make_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Build a tiny random-weight checkpoint of `arch` into `out_dir` and return the path.

    Same arch, seed and overrides give byte-identical weights. `config_overrides` update the HF
    config kwargs (e.g. num_hidden_layers=3, tie_word_embeddings=False, dtype="bfloat16").
    """
    builders = tiny_checkpoint_builders()
    if arch not in builders:
        raise ValueError(f"unknown tiny-model arch {arch!r}; supported: {sorted(builders)}")
    from vllm_omni.imports import import_dotted

    builder: ArchBuilder = import_dotted(builders[arch])
    if "torch_dtype" in config_overrides:  # transformers 5 renamed it; accept the old name
        config_overrides["dtype"] = config_overrides.pop("torch_dtype")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Seed just before the builder so weights depend only on (arch, seed, overrides); fork
    # the RNG so the caller's random stream is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        builder(out_dir, dict(config_overrides))
    return out_dir


def save_hf_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    """What a hub checkpoint holds: weights and config, tokenizer, generation config."""
    text_config = model.config.get_text_config()
    if text_config.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {text_config.vocab_size} < tokenizer size {len(tokenizer)}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    special_ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    GenerationConfig(
        bos_token_id=None, eos_token_id=special_ids, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out_dir)


def cache_dir() -> Path:
    return Path(envs.CACHE.get() or Path.home() / ".cache" / "vllm_omni")


def demo_model_path(arch: str = DEMO_ARCH) -> Path:
    """An embedded demo model (seed 0), built once into the cache dir: by default the tiny
    Qwen2.5-Omni (text + speech out), "qwen3" for a plain text LM.

    Safe against concurrent builders: each builds into its own temp dir and renames it into
    place; the folder therefore exists only when complete, and a losing builder discards its copy.
    """
    if arch not in DEMO_MODELS:
        raise ValueError(f"no demo model for {arch!r}; available: {sorted(DEMO_MODELS)}")
    checkpoint, name = DEMO_MODELS[arch]
    target = cache_dir() / name
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
    try:
        make_tiny_model(checkpoint, tmp, seed=0)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
