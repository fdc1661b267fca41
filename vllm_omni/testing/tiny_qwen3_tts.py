"""Tiny random Qwen3-TTS checkpoint in the released layout, registered as "qwen3_tts".

    python -m vllm_omni.testing qwen3_tts DIR [--task-type CustomVoice|VoiceDesign|Base] [--set size=0.6B]
    make_tiny_model("qwen3_tts", d, task_type="Base", size="0.6B")

The folder holds what a hub checkpoint holds and what `qwen_tts.Qwen3TTSModel.from_pretrained`
reads: config.json (`tts_model_type` custom_voice / voice_design / base), model.safetensors
(`talker.*`, plus `speaker_encoder.*` for Base), generation_config.json (qwen-tts' sampling
defaults), the tokenizer, and speech_tokenizer/ (the 12 Hz codec: config.json, the Mimi
encoder's and the decoder's weights, preprocessor_config.json).

Sizes: talker 2 layers of width 64 over a 1088-code vocabulary (64 codes + the 1024 control
ids, as released: 2048 + 1024), 4 code groups, the released 1920 samples per frame at 24 kHz.
`size="0.6B"` is shaped as the 0.6B releases are against the 1.7B ones (tts_model_size "0b6"):
a talker narrower than its text embeddings (released 1024 vs 2048: here 32 vs 64) and as wide
as its code predictor, so the predictor has no `small_to_mtp_projection` (qwen-tts: Identity);
the speaker encoder's output is the talker's width.
Weights are "decisive" (large init, see notes): greedy codes stay diverse for dozens of frames.
Other overrides update the top-level config dict; `talker_config` / `code_predictor_config`
dicts update those sections.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from vllm_omni.testing.tokenizer import make_tiny_tokenizer

CODEBOOK = 64
NUM_GROUPS = 4
TALKER_VOCAB = CODEBOOK + 1024
TALKER_HIDDEN = 64
INIT_STD = 0.5  # linear and embedding weights (decisive, see the module doc)
SPEAKERS = {"vivian": CODEBOOK + 11, "ryan": CODEBOOK + 12, "eric": CODEBOOK + 13}
DIALECTS = {"vivian": False, "ryan": False, "eric": "sichuan_dialect"}
LANGUAGES = {"english": CODEBOOK + 7, "chinese": CODEBOOK + 8, "german": CODEBOOK + 9,
             "sichuan_dialect": CODEBOOK + 10}
GENERATION_CONFIG = {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
                     "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0,
                     "subtalker_top_k": 50, "max_new_tokens": 8192}
TASK_TYPES = {"CustomVoice": "custom_voice", "VoiceDesign": "voice_design", "Base": "base"}
# size -> (tts_model_size, talker width, text embedding width); the code predictor is 32 wide
SIZES = {"1.7B": ("1b7", TALKER_HIDDEN, 32), "0.6B": ("0b6", 32, 64)}
PREDICTOR_HIDDEN = 32

DECODER_CONFIG = dict(codebook_size=CODEBOOK, codebook_dim=16, hidden_size=32, latent_dim=32,
                      max_position_embeddings=8000, rope_theta=10000, num_attention_heads=2, num_key_value_heads=2,
                      attention_bias=False, sliding_window=8, intermediate_size=64, hidden_act="silu",
                      layer_scale_initial_scale=0.01, rms_norm_eps=1e-5, num_hidden_layers=2,
                      num_quantizers=NUM_GROUPS, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
                      decoder_dim=64, attention_dropout=0.0)
# Mimi (transformers' MimiModel) at 12.5 Hz: 960x conv downsampling, then 2x.
ENCODER_CONFIG = dict(sampling_rate=24000, audio_channels=1, hidden_size=32, num_filters=4, num_residual_layers=1,
                      upsampling_ratios=[8, 6, 5, 4], kernel_size=7, last_kernel_size=3, residual_kernel_size=3,
                      dilation_growth_rate=2, use_causal_conv=True, pad_mode="constant", compress=2,
                      trim_right_ratio=1.0, codebook_size=CODEBOOK, codebook_dim=16, num_quantizers=8,
                      use_conv_shortcut=False, vector_quantization_hidden_dimension=16, num_semantic_quantizers=1,
                      upsample_groups=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, hidden_act="gelu", max_position_embeddings=8000,
                      norm_eps=1e-5, use_cache=False, use_streaming=False, rope_theta=10000.0, sliding_window=16,
                      attention_dropout=0.0, layer_scale_initial_scale=0.01, attention_bias=False,
                      frame_rate=12.5)
DECODER_CONV_GAIN = 1.4
FEATURE_EXTRACTOR = {"feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1, "padding_side": "right",
                     "padding_value": 0.0, "return_attention_mask": True, "sampling_rate": 24000,
                     "chunk_length_s": None, "overlap": None}


def build_config_dict(tokenizer, overrides: dict[str, Any]) -> dict[str, Any]:
    overrides = dict(overrides)
    task_type = overrides.pop("task_type", "CustomVoice")
    if task_type not in TASK_TYPES:
        raise ValueError(f"task_type must be one of {sorted(TASK_TYPES)}, got {task_type!r}")
    size = overrides.pop("size", "1.7B")
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if size == "0.6B" and task_type == "VoiceDesign":
        raise ValueError("VoiceDesign is released at 1.7B only")
    model_size, hidden, text_hidden = SIZES[size]
    ids = tokenizer.convert_tokens_to_ids
    code_predictor = dict(vocab_size=CODEBOOK, hidden_size=PREDICTOR_HIDDEN, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, hidden_act="silu",
                          max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000000, rope_scaling=None,
                          attention_bias=False, use_sliding_window=False, num_code_groups=NUM_GROUPS,
                          layer_types=["full_attention"] * 2, model_type="qwen3_tts_talker_code_predictor")
    code_predictor.update(overrides.pop("code_predictor_config", {}))
    talker = dict(
        code_predictor_config=code_predictor, vocab_size=TALKER_VOCAB, hidden_size=hidden,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000,
        rope_scaling={"interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default", "type": "default"},
        attention_bias=False, use_sliding_window=False, num_code_groups=NUM_GROUPS, position_id_per_seconds=13,
        text_hidden_size=text_hidden, text_vocab_size=-(-len(tokenizer) // 64) * 64,
        codec_pad_id=CODEBOOK, codec_bos_id=CODEBOOK + 1, codec_eos_token_id=CODEBOOK + 2,
        codec_think_id=CODEBOOK + 3, codec_nothink_id=CODEBOOK + 4, codec_think_bos_id=CODEBOOK + 5,
        codec_think_eos_id=CODEBOOK + 6, codec_language_id=dict(LANGUAGES), spk_id=dict(SPEAKERS),
        spk_is_dialect=dict(DIALECTS), model_type="qwen3_tts_talker")
    talker.update(overrides.pop("talker_config", {}))
    config = dict(
        architectures=["Qwen3TTSForConditionalGeneration"], model_type="qwen3_tts",
        tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size=model_size, tts_model_type=TASK_TYPES[task_type],
        assistant_token_id=ids("assistant"), im_start_token_id=ids("<|im_start|>"), im_end_token_id=ids("<|im_end|>"),
        tts_pad_token_id=ids("<tts_pad>"), tts_bos_token_id=ids("<tts_text_bos>"),
        tts_eos_token_id=ids("<tts_text_eod>"), talker_config=talker, dtype="float32")
    if task_type == "Base":
        config["speaker_encoder_config"] = dict(mel_dim=128, enc_dim=hidden, enc_channels=[32, 32, 32, 32, 96],
                                                enc_kernel_sizes=[5, 3, 3, 3, 1], enc_dilations=[1, 2, 3, 4, 1],
                                                enc_attention_channels=16, enc_res2net_scale=2, enc_se_channels=16,
                                                sample_rate=24000)
    config.update(overrides)
    return config


def _randn(*shape: int, std: float = INIT_STD) -> torch.Tensor:
    return torch.randn(*shape) * std


def _norm(dim: int) -> torch.Tensor:
    return 1.0 + torch.randn(dim) * 0.2  # not 1: a norm loaded into the wrong place must show


def _decoder_layers(prefix: str, c: dict[str, Any]) -> dict[str, torch.Tensor]:
    hidden, heads, kv, head_dim = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    inter, out = c["intermediate_size"], {}
    for i in range(c["num_hidden_layers"]):
        p = f"{prefix}layers.{i}."
        out.update({f"{p}self_attn.q_proj.weight": _randn(heads * head_dim, hidden),
                    f"{p}self_attn.k_proj.weight": _randn(kv * head_dim, hidden),
                    f"{p}self_attn.v_proj.weight": _randn(kv * head_dim, hidden),
                    f"{p}self_attn.o_proj.weight": _randn(hidden, heads * head_dim),
                    f"{p}self_attn.q_norm.weight": _norm(head_dim), f"{p}self_attn.k_norm.weight": _norm(head_dim),
                    f"{p}mlp.gate_proj.weight": _randn(inter, hidden), f"{p}mlp.up_proj.weight": _randn(inter, hidden),
                    f"{p}mlp.down_proj.weight": _randn(hidden, inter),
                    f"{p}input_layernorm.weight": _norm(hidden), f"{p}post_attention_layernorm.weight": _norm(hidden)})
    out[f"{prefix}norm.weight"] = _norm(hidden)
    return out


def talker_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    t, cp = config["talker_config"], config["talker_config"]["code_predictor_config"]
    hidden, text_hidden = t["hidden_size"], t["text_hidden_size"]
    out = _decoder_layers("talker.model.", t)
    out.update({"talker.model.codec_embedding.weight": _randn(t["vocab_size"], hidden),
                "talker.model.text_embedding.weight": _randn(t["text_vocab_size"], text_hidden),
                "talker.text_projection.linear_fc1.weight": _randn(text_hidden, text_hidden),
                "talker.text_projection.linear_fc1.bias": _randn(text_hidden, std=0.1),
                "talker.text_projection.linear_fc2.weight": _randn(hidden, text_hidden),
                "talker.text_projection.linear_fc2.bias": _randn(hidden, std=0.1),
                "talker.codec_head.weight": _randn(t["vocab_size"], hidden)})
    out.update(_decoder_layers("talker.code_predictor.model.", cp))
    for g in range(cp["num_code_groups"] - 1):
        out[f"talker.code_predictor.model.codec_embedding.{g}.weight"] = _randn(cp["vocab_size"], hidden)
        out[f"talker.code_predictor.lm_head.{g}.weight"] = _randn(cp["vocab_size"], cp["hidden_size"])
    if cp["hidden_size"] != hidden:
        out["talker.code_predictor.small_to_mtp_projection.weight"] = _randn(cp["hidden_size"], hidden)
        out["talker.code_predictor.small_to_mtp_projection.bias"] = _randn(cp["hidden_size"], std=0.1)
    return out


def _perturbed_state(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """A module's default-initialised weights, with the constant ones (norms at 1, codebook
    usage, layer scales, SnakeBeta's zeros) made random so every tensor matters."""
    out = {}
    for name, param in module.state_dict().items():
        value = param.detach().clone()
        if name.endswith("cluster_usage"):
            value = torch.rand_like(value) + 0.5
        elif name.endswith("embedding_sum"):
            value = torch.randn_like(value)
        elif value.numel() > 1 and bool((value == value.flatten()[0]).all()):
            value = value + torch.randn_like(value) * 0.2
        out[prefix + name] = value.contiguous()
    return out


def speech_tokenizer_weights() -> dict[str, torch.Tensor]:
    from transformers import MimiConfig, MimiModel

    from vllm_omni.model_executor.models.qwen3_tts.speech_decoder import SpeechDecoder
    from vllm_omni.model_executor.models.qwen3_tts.speech_encoder import ENCODER_PREFIX, to_released_name

    out = _perturbed_state(SpeechDecoder(DECODER_CONFIG), "decoder.")
    # Default conv init fades the codes out over ~20 conv layers and the biases make most of the
    # waveform; scaled like this the samples depend on the codes (std ~0.2, rarely clipped).
    for name in out:
        if name.endswith("conv.weight"):
            out[name] = out[name] * DECODER_CONV_GAIN
        elif name.endswith("conv.bias"):
            out[name] = out[name] * 0.1
    mimi = MimiModel(MimiConfig(**ENCODER_CONFIG))
    # qwen-tts' encoder is a MimiModel without its decoding half, saved with transformers 4 names.
    for name, value in _perturbed_state(mimi, "").items():
        released = to_released_name(name)
        if released is not None:
            out[ENCODER_PREFIX + released] = value
    return out


def speaker_encoder_weights(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    from vllm_omni.model_executor.models.qwen3_tts.configuration import SpeakerEncoderConfig
    from vllm_omni.model_executor.models.qwen3_tts.speaker_encoder import SpeakerEncoder

    encoder = SpeakerEncoder(SpeakerEncoderConfig(**config["speaker_encoder_config"]))
    return _perturbed_state(encoder, "speaker_encoder.")


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """The tokenizer, readable by transformers 4.57 (qwen-tts' pin) too: transformers 5 writes
    `extra_special_tokens` as a list there, which 4.x cannot read; the TTS model needs none."""
    tokenizer.save_pretrained(out_dir)
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if not config.get("extra_special_tokens"):
        config.pop("extra_special_tokens", None)
    path.write_text(json.dumps(config, indent=2))


def build_tiny_qwen3_tts(out_dir: Path, overrides: dict[str, Any]) -> None:
    tokenizer = make_tiny_tokenizer()
    config = build_config_dict(tokenizer, overrides)
    weights = talker_weights(config)
    if "speaker_encoder_config" in config:
        weights.update(speaker_encoder_weights(config))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(tokenizer, out_dir)
    speech = out_dir / "speech_tokenizer"
    speech.mkdir(exist_ok=True)
    speech_config = {"architectures": ["Qwen3TTSTokenizerV2Model"], "model_type": "qwen3_tts_tokenizer_12hz",
                     "encoder_config": ENCODER_CONFIG, "decoder_config": DECODER_CONFIG,
                     "encoder_valid_num_quantizers": NUM_GROUPS, "input_sample_rate": 24000,
                     "output_sample_rate": 24000, "decode_upsample_rate": 1920, "encode_downsample_rate": 1920}
    (speech / "config.json").write_text(json.dumps(speech_config, indent=2))
    (speech / "preprocessor_config.json").write_text(json.dumps(FEATURE_EXTRACTOR, indent=2))
    save_file(speech_tokenizer_weights(), str(speech / "model.safetensors"), metadata={"format": "pt"})
