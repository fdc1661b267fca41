"""Config of the tiny Qwen2.5-Omni checkpoint: defaults, overrides, derived fields.

Overrides (the kwargs of `make_tiny_model("qwen2_5_omni", ...)`), applied in this order:
  1. nested dicts under the HF config's own keys (`thinker_config`, `talker_config`,
     `token2wav_config`) and the plain `enable_audio_output` / `dtype` are deep-merged into
     the defaults, e.g. `thinker_config={"text_config": {"num_hidden_layers": 3}}`;
  2. prefixed shorthands set one field of one sub-config: `thinker_*` -> thinker text config,
     `audio_*` -> audio encoder, `vision_*` -> vision encoder, `talker_*` -> talker,
     `dit_*` / `bigvgan_*` -> token2wav parts (e.g. `thinker_hidden_size=96`, `vision_depth=2`);
  3. fields that must agree with others are derived unless set explicitly: the encoders'
     output sizes and the talker's `embedding_size` follow the thinker hidden size, and each
     `mrope_section` is recomputed for its head_dim (it must sum to head_dim / 2).
Unknown keys and unknown field names raise ValueError: HF configs keep any kwarg as a plain
attribute, so a typo would otherwise build the default model without a word.
"""

from __future__ import annotations

from typing import Any

from vllm_omni.testing.config_overrides import apply_overrides, check_field_names
from vllm_omni.testing.tiny_models import tiny_vocab_size

CODEC_VOCAB = 128
CODEC_PAD, CODEC_START, CODEC_END, CODEC_MASK = 124, 125, 126, 127
# Large init keeps greedy thinker text and talker codes from collapsing (see tiny_models.py).
INIT_RANGE = 0.5
# Token2wav needs its own scales (measured: mel and waveform change 32% / 8% between two random
# code sequences, no clipping). With defaults the waveform barely depends on the codes (4e-5
# relative): the DiT's small velocity leaves the seeded start noise dominant, and the vocoder's
# output is its (perturbed) biases. Larger vocoder weights clip the waveform to +-1.
DIT_INIT_RANGE = 0.1
BIGVGAN_INIT_RANGE = 0.05
CODEC_EMBED_STD = 1.0  # the codes are 16 of the DiT's 128 input features, next to N(0,1) noise
BIGVGAN_PERTURB_STD = 0.02


_SHORTHAND_PREFIXES = {  # no prefix is a prefix of another, so the first match is the only one
    "bigvgan_": ("token2wav_config", "bigvgan_config"),
    "thinker_": ("thinker_config", "text_config"),
    "vision_": ("thinker_config", "vision_config"),
    "talker_": ("talker_config",),
    "audio_": ("thinker_config", "audio_config"),
    "dit_": ("token2wav_config", "dit_config"),
}
_TOP_LEVEL_KEYS = {"thinker_config", "talker_config", "token2wav_config", "enable_audio_output", "dtype"}


def _default_config(tokenizer) -> dict[str, Any]:
    """The notes' "Tiny Qwen2.5-Omni that runs" sizes, as a nested config dict."""
    ids = tokenizer.convert_tokens_to_ids
    mm_ids = dict(
        audio_token_index=ids("<|AUDIO|>"),
        image_token_index=ids("<|IMAGE|>"),
        video_token_index=ids("<|VIDEO|>"),
        audio_start_token_id=ids("<|audio_bos|>"),
        audio_end_token_id=ids("<|audio_eos|>"),
    )
    text = dict(
        vocab_size=tiny_vocab_size(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=ids("<|im_end|>"),
        bos_token_id=None,
    )
    audio = dict(
        num_mel_bins=128,
        encoder_layers=1,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        d_model=32,
        n_window=100,
        max_source_positions=1500,
        initializer_range=INIT_RANGE,
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[0],
        initializer_range=INIT_RANGE,
    )
    thinker = dict(
        text_config=text,
        audio_config=audio,
        vision_config=vision,
        user_token_id=ids("user"),
        # Undeclared by the config class but read by get_rope_index (the released config has them).
        vision_start_token_id=ids("<|vision_bos|>"),
        vision_end_token_id=ids("<|vision_eos|>"),
        initializer_range=INIT_RANGE,
        **mm_ids,
    )
    talker = dict(
        vocab_size=CODEC_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
        tts_codec_pad_token_id=CODEC_PAD,
        tts_codec_start_token_id=CODEC_START,
        tts_codec_end_token_id=CODEC_END,
        tts_codec_mask_token_id=CODEC_MASK,
        tts_text_pad_token_id=ids("<tts_pad>"),
        tts_text_start_token_id=ids("<tts_text_bos>"),
        tts_text_end_token_id=ids("<tts_text_eod>"),
        vision_start_token_id=ids("<|vision_bos|>"),
        vision_end_token_id=ids("<|vision_eos|>"),
        **mm_ids,
    )
    dit = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=16,
        ff_mult=2,
        emb_dim=16,
        mel_dim=80,
        num_embeds=CODEC_VOCAB,
        repeats=2,
        block_size=24,
        look_ahead_layers=[0],
        look_backward_layers=[1],
        enc_emb_dim=16,
        enc_dim=16,
        enc_channels=[32, 32, 32, 32, 96],  # last = sum of the middle three (it concatenates them)
        enc_kernel_sizes=[5, 3, 3, 3, 1],
        enc_dilations=[1, 2, 3, 4, 1],
        enc_attention_channels=16,
        enc_res2net_scale=2,
        enc_se_channels=16,
        dropout=0.0,
        initializer_range=DIT_INIT_RANGE,
    )
    bigvgan = dict(
        mel_dim=80,
        upsample_initial_channel=32,
        resblock_kernel_sizes=[3],
        resblock_dilation_sizes=[[1, 3, 5]],
        upsample_rates=[5, 4],
        upsample_kernel_sizes=[11, 8],
        initializer_range=BIGVGAN_INIT_RANGE,
    )
    return dict(
        thinker_config=thinker,
        talker_config=talker,
        token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan),
        enable_audio_output=True,
        dtype="float32",
    )


def _mrope_section(head_dim: int) -> list[int]:
    # The released split [16, 24, 24] of a 128 head_dim, generalized: height and width get
    # 3/8 of the rotary half each, time the rest. Must sum to head_dim / 2.
    half = head_dim // 2
    hw = 3 * half // 8
    return [half - 2 * hw, hw, hw]


def _mrope(head_dim: int) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": 1e6, "mrope_section": _mrope_section(head_dim)}


def build_config_dict(tokenizer, overrides: dict[str, Any]) -> dict[str, Any]:
    """Defaults + overrides (see the module docstring) -> the kwargs of Qwen2_5OmniConfig."""
    cfg = _default_config(tokenizer)
    unset = apply_overrides(cfg, overrides, arch="qwen2_5_omni", top_level_keys=_TOP_LEVEL_KEYS,
                            shorthand_prefixes=_SHORTHAND_PREFIXES)
    thinker = cfg["thinker_config"]
    text = thinker["text_config"]
    hidden = text["hidden_size"]
    # Everything the thinker consumes or feeds must match its hidden size.
    derived = [
        (("thinker_config", "audio_config"), thinker["audio_config"], "output_dim"),
        (("thinker_config", "vision_config"), thinker["vision_config"], "out_hidden_size"),
        (("talker_config",), cfg["talker_config"], "embedding_size"),
    ]
    for path, section, field in derived:
        if unset(path, field):
            section[field] = hidden
    if unset(("thinker_config", "text_config"), "rope_parameters"):
        text["rope_parameters"] = _mrope(text.get("head_dim") or hidden // text["num_attention_heads"])
    talker = cfg["talker_config"]
    if unset(("talker_config",), "rope_parameters"):
        talker["rope_parameters"] = _mrope(talker["head_dim"])
    _check_field_names(cfg, _default_config(tokenizer))
    return cfg


_SECTION_CLASSES = {
    ("thinker_config",): "Qwen2_5OmniThinkerConfig",
    ("thinker_config", "text_config"): "Qwen2_5OmniTextConfig",
    ("thinker_config", "audio_config"): "Qwen2_5OmniAudioEncoderConfig",
    ("thinker_config", "vision_config"): "Qwen2_5OmniVisionEncoderConfig",
    ("talker_config",): "Qwen2_5OmniTalkerConfig",
    ("token2wav_config",): "Qwen2_5OmniToken2WavConfig",
    ("token2wav_config", "dit_config"): "Qwen2_5OmniDiTConfig",
    ("token2wav_config", "bigvgan_config"): "Qwen2_5OmniBigVGANConfig",
}


def _check_field_names(cfg: dict[str, Any], defaults: dict[str, Any]) -> None:
    import transformers

    check_field_names(cfg, defaults, _SECTION_CLASSES, lambda name: getattr(transformers, name))
