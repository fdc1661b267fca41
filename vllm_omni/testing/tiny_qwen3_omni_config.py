"""Config of the tiny Qwen3-Omni-MoE checkpoint: defaults, overrides, derived fields.

Overrides (the kwargs of `make_tiny_model("qwen3_omni_moe", ...)`), applied in this order:
  1. nested dicts under the HF config's own keys (`thinker_config`, `talker_config`,
     `code2wav_config`) and the plain `enable_audio_output` / `dtype` are deep-merged into the
     defaults, e.g. `talker_config={"accept_hidden_layer": 2}`;
  2. prefixed shorthands set one field of one sub-config: `thinker_*` -> thinker text model,
     `audio_*` / `vision_*` -> the encoders, `talker_*` -> talker text model, `code_predictor_*`
     -> the talker's code predictor, `code2wav_*` -> code2wav (e.g. `thinker_num_hidden_layers=3`);
  3. fields that must agree with others are derived unless set explicitly: the encoders' output
     sizes and the talker's `thinker_hidden_size` follow the thinker hidden size; the number of
     code groups and the codebook size follow code2wav (`num_quantizers`, `codebook_size`), and
     with them the codec vocabulary and its special ids; each `mrope_section` follows its head_dim.
Unknown keys and field names raise ValueError, as for qwen2_5_omni.
"""

from __future__ import annotations

from typing import Any

from vllm_omni.testing.config_overrides import Unset, apply_overrides, check_field_names
from vllm_omni.testing.tiny_models import tiny_vocab_size

# Large init keeps greedy thinker text and talker codes from collapsing (see tiny_models.py).
INIT_RANGE = 0.5
# Code2wav needs its own scales (measured over 3 seeds: the waveforms of two random code
# sequences differ by 80-110% of their std, waveform std ~0.04, no clipping). With the default
# 0.02 the waveform is its perturbed biases (1-7% code dependence); from 0.08 it starts clipping
# to +-1, and from 0.2 it is all clipped.
CODE2WAV_INIT_RANGE = 0.06
CODE2WAV_PERTURB_STD = 0.1
# The talker's codec vocabulary: the codebook, then 1024 ids of which the generate() loop
# suppresses all but codec_eos (the released layout: 2048 codes, vocab 3072).
CODEC_EXTRA = 1024
SPEAKERS = ("ethan", "chelsie")
# The codec special ids follow the codebook: pad, bos, eos, nothink, think_bos, think_eos, then
# one id per speaker. (The released ones start at 2148 for a 2048 codebook; any ids in the
# suppressed range work, and eos must be the only one the talker can emit.)
_CODEC_SPECIALS = ("codec_pad_id", "codec_bos_id", "codec_eos_token_id", "codec_nothink_id",
                   "codec_think_bos_id", "codec_think_eos_id")

_SHORTHAND_PREFIXES = {  # no prefix is a prefix of another, so the first match is the only one
    "thinker_": ("thinker_config", "text_config"),
    "audio_": ("thinker_config", "audio_config"),
    "vision_": ("thinker_config", "vision_config"),
    "talker_": ("talker_config", "text_config"),
    "code_predictor_": ("talker_config", "code_predictor_config"),
    "code2wav_": ("code2wav_config",),
}
_TOP_LEVEL_KEYS = {"thinker_config", "talker_config", "code2wav_config", "enable_audio_output", "dtype"}


def codec_ids(codebook_size: int) -> dict[str, Any]:
    """The talker's codec special ids for a codebook size (also used by tests)."""
    ids: dict[str, Any] = {name: codebook_size + i for i, name in enumerate(_CODEC_SPECIALS)}
    ids["speaker_id"] = {name: codebook_size + len(_CODEC_SPECIALS) + i for i, name in enumerate(SPEAKERS)}
    return ids


def _default_config(tokenizer) -> dict[str, Any]:
    """The notes' "Tiny Qwen3-Omni-MoE that runs" sizes, as a nested config dict."""
    ids = tokenizer.convert_tokens_to_ids
    mm_ids = dict(
        audio_token_id=ids("<|audio_pad|>"),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        audio_start_token_id=ids("<|audio_start|>"),
        # Undeclared by the thinker config class but read by get_rope_index.
        vision_start_token_id=ids("<|vision_start|>"),
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True)
    text = dict(
        vocab_size=tiny_vocab_size(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
        max_position_embeddings=4096, initializer_range=INIT_RANGE, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=ids("<|im_end|>"), bos_token_id=None, **moe,
    )
    audio = dict(
        num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
        # n_window stays 50: transformers' processor counts 13 tokens per 100 frames, right only for 50.
        n_window=50, n_window_infer=800, conv_chunksize=500, downsample_hidden_size=16,
        max_source_positions=1500, initializer_range=INIT_RANGE,
    )
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, num_position_embeddings=64,  # a square: a grid of learned positions
        deepstack_visual_indexes=[0], initializer_range=INIT_RANGE,
    )
    thinker = dict(
        text_config=text, audio_config=audio, vision_config=vision, user_token_id=ids("user"),
        position_id_per_seconds=13, seconds_per_chunk=2, initializer_range=INIT_RANGE, **mm_ids,
    )
    talker_text = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, moe_intermediate_size=16,
        shared_expert_intermediate_size=32,  # read by the talker's MoE block, though undeclared
        max_position_embeddings=4096, initializer_range=INIT_RANGE, **moe,
    )
    code_predictor = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, max_position_embeddings=4096, initializer_range=INIT_RANGE,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    talker = dict(
        text_config=talker_text, code_predictor_config=code_predictor,
        accept_hidden_layer=1,  # which thinker hidden state feeds the talker (of 2 layers + embeddings)
        position_id_per_seconds=13, spatial_merge_size=2,  # read by the talker, undeclared
        initializer_range=INIT_RANGE, **mm_ids,
    )
    code2wav = dict(
        codebook_size=64, num_quantizers=4, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, sliding_window=16, upsample_rates=[2, 2],
        upsampling_ratios=[2], decoder_dim=32, initializer_range=CODE2WAV_INIT_RANGE,
    )
    return dict(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
        enable_audio_output=True, dtype="float32",
        # Top-level ids the generate() loop uses to find the user / assistant turns.
        im_start_token_id=ids("<|im_start|>"), im_end_token_id=ids("<|im_end|>"),
        tts_pad_token_id=ids("<tts_pad>"), tts_bos_token_id=ids("<tts_text_bos>"),
        tts_eos_token_id=ids("<tts_text_eod>"), system_token_id=ids("system"),
        user_token_id=ids("user"), assistant_token_id=ids("assistant"),
    )


def _mrope(head_dim: int) -> dict[str, Any]:
    # The released split [24, 20, 20] of a 128 head_dim, generalized (interleaved sections):
    # height and width get 5/16 of the rotary half each, time the rest. Sums to head_dim / 2.
    half = head_dim // 2
    hw = 5 * half // 16
    return {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [half - 2 * hw, hw, hw], "interleaved": True}


def build_config_dict(tokenizer, overrides: dict[str, Any]) -> dict[str, Any]:
    """Defaults + overrides (see the module docstring) -> the kwargs of Qwen3OmniMoeConfig."""
    cfg = _default_config(tokenizer)
    unset = apply_overrides(cfg, overrides, arch="qwen3_omni_moe", top_level_keys=_TOP_LEVEL_KEYS,
                            shorthand_prefixes=_SHORTHAND_PREFIXES)
    _derive(cfg, unset)
    _check_field_names(cfg, _default_config(tokenizer))
    return cfg


def _derive(cfg: dict[str, Any], unset: Unset) -> None:
    thinker, talker, code2wav = cfg["thinker_config"], cfg["talker_config"], cfg["code2wav_config"]
    text, talker_text, predictor = thinker["text_config"], talker["text_config"], talker["code_predictor_config"]
    hidden = text["hidden_size"]
    # Everything the thinker consumes or feeds must match its hidden size.
    for path, section, field in [
        (("thinker_config", "audio_config"), thinker["audio_config"], "output_dim"),
        (("thinker_config", "vision_config"), thinker["vision_config"], "out_hidden_size"),
        (("talker_config",), talker, "thinker_hidden_size"),
    ]:
        if unset(path, field):
            section[field] = hidden
    # The talker predicts code group 0, the code predictor the others, code2wav decodes them all.
    codebook, groups = code2wav["codebook_size"], code2wav["num_quantizers"]
    for path, section, field, value in [
        (("talker_config",), talker, "num_code_groups", groups),
        (("talker_config", "code_predictor_config"), predictor, "num_code_groups", groups),
        (("talker_config", "code_predictor_config"), predictor, "vocab_size", codebook),
        (("talker_config", "text_config"), talker_text, "vocab_size", codebook + CODEC_EXTRA),
    ]:
        if unset(path, field):
            section[field] = value
    for field, value in codec_ids(codebook).items():
        if unset(("talker_config",), field):
            talker[field] = value
    for path, section in [(("thinker_config", "text_config"), text), (("talker_config", "text_config"), talker_text)]:
        if unset(path, "rope_parameters"):
            head_dim = section.get("head_dim") or section["hidden_size"] // section["num_attention_heads"]
            section["rope_parameters"] = _mrope(head_dim)


_SECTION_CLASSES = {
    ("thinker_config",): "Qwen3OmniMoeThinkerConfig",
    ("thinker_config", "text_config"): "Qwen3OmniMoeTextConfig",
    ("thinker_config", "audio_config"): "Qwen3OmniMoeAudioEncoderConfig",
    ("thinker_config", "vision_config"): "Qwen3OmniMoeVisionEncoderConfig",
    ("talker_config",): "Qwen3OmniMoeTalkerConfig",
    ("talker_config", "text_config"): "Qwen3OmniMoeTalkerTextConfig",
    ("talker_config", "code_predictor_config"): "Qwen3OmniMoeTalkerCodePredictorConfig",
    ("code2wav_config",): "Qwen3OmniMoeCode2WavConfig",
}


def _check_field_names(cfg: dict[str, Any], defaults: dict[str, Any]) -> None:
    import transformers
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as module

    check_field_names(cfg, defaults, _SECTION_CLASSES,
                      lambda name: getattr(transformers, name, None) or getattr(module, name))
