"""The embedded demo: a tiny random Qwen2.5-Omni whose weights are shaped so that a person can
read and hear it (what `vllm-omni serve` / `generate` run without a model).

A random model babbles: its thinker samples byte tokens that decode to replacement characters,
never ends a reply, and its talker stops after a few codes (a click). Edits of the random
weights, each a plain linear-algebra fact that transformers computes as we do, make the demo
behave like a (very dull) trained model on every path, with no sampling tricks in the engine:

- Words only. The thinker's residual stream gets a constant coordinate (every token embedding
  has the same value there and no layer writes to it), so after the final RMSNorm that
  coordinate is positive at every position. The output rows of every token that is not a space
  and a whole word of the tokenizer's corpus (byte pieces, sub-words, special tokens,
  `<|im_end|>`) weigh it by -WORD_ONLY_PENALTY: they lose to the words by more than 50 logits
  (measured), at any sane temperature. A reply is therefore `max_tokens` random words; the
  demo's own deploy settings (DEMO_DEPLOY) make that short by default.
- Speech that follows the text: one codec code per word. The talker reads the thinker's reply
  row by row and, once the reply is over, `<tts_pad>` rows. A coordinate that only the
  `<tts_pad>` embedding sets (the thinker zeroes it in its own states) raises codec end's logit
  there; a constant coordinate of the talker lowers codec end and codec pad (its other stop
  code) everywhere else. So the talker speaks exactly one code per reply token, then stops.
- Codes long enough to hear: the vocoder upsamples each mel frame 1200x (DEMO_BUILD_OVERRIDES),
  so one code (2 mel frames) is 0.1 s of 24 kHz audio, and the DiT's blocks are one code, so
  streamed speech arrives in chunks of a few words. The DiT's output is centred and widened in
  the vocoder's input range, so the sound depends on the codes (and the voice), not mostly on
  the vocoder's response to a constant.

Voices differ as in the real model: each speaker has its own text-side bos row (so the talker
samples other codes) and its own DiT conditioning.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

# The vocoder's upsampling per mel frame (x2 frames per code: 0.1 s per code at 24 kHz), with an
# even kernel - stride like the released checkpoint's, initialized loud enough to hear (measured
# after _loud_enough: rms 0.06, peak 0.33, no clipping); DiT blocks of 2 mel frames (1 code), so
# streamed speech comes in chunks of 3, 3, 6, 12 codes (words).
DEMO_BUILD_OVERRIDES: dict[str, Any] = dict(
    bigvgan_upsample_rates=[5, 5, 4, 4, 3], bigvgan_upsample_kernel_sizes=[11, 11, 8, 8, 7],
    bigvgan_upsample_initial_channel=64, bigvgan_initializer_range=0.09, dit_block_size=2)
SECONDS_PER_CODE = 0.1
DEFAULT_REPLY_TOKENS = 24  # the thinker's default max_tokens: 24 words, 2.4 s of speech

# The demo's own stage settings, applied over the bundled deploy config whenever no config file is
# given (config/checkpoint_deploy.py). A request may ask for other lengths (`max_tokens`), up to
# caps (`max_tokens_limit`: a default alone is no cap) that keep one request from holding a CPU for
# minutes: the talker speaks one code per word plus its stop code, so its 512 cover the thinker's
# longest reply.
DEMO_DEPLOY = f"""\
# The embedded demo's own settings (vllm_omni/testing/demo_model.py), over the bundled deploy
# config of Qwen2.5-Omni: short replies unless a request asks for more.
stages:
  - stage_id: 0  # thinker
    max_tokens_limit: 256
    default_sampling_params:
      max_tokens: {DEFAULT_REPLY_TOKENS}
  - stage_id: 1  # talker
    max_tokens_limit: 512
    default_sampling_params:
      max_tokens: 512
"""

# Thinker: the residual stream's rms is ~100 at the last layer, so the constant coordinate is
# ~0.01 after the final norm; 10000 puts other tokens 60-100 logits below the words.
WORD_ONLY_PENALTY = 10000.0
_THINKER_CONST = 0  # thinker coordinates: the constant one, and the one only <tts_pad> sets
_THINKER_PAD = 1
_TALKER_CONST = 0  # talker coordinates: constant, and "the reply is over"
_TALKER_PAD = 1
_PAD_VALUE = 50.0  # dominates the talker's norm on <tts_pad> rows
_TALKER_CONST_VALUE = 4.0
_STOP_WEIGHT = 20.0
_THINKER_VOICE = 2  # thinker and talker coordinates only the speakers' bos rows set
_TALKER_VOICE = 2
_VOICE_MARK = 3.0
_VOICE_KEY = 10.0
_VOICE_QUERY = 10.0
_CODE_EMBED_GAIN = 3.0
_MEL_GAIN = 6.0
_MEL_CENTRE = -4.3
_VOCODER_GAIN = 2.0


def demo_words(tokenizer) -> dict[int, str]:
    """id -> text of the tokens the demo's thinker may say: a space and a whole corpus word."""
    from vllm_omni.testing.tokenizer import CORPUS

    words = {w for line in CORPUS for w in re.findall(r"[A-Za-z]+", line)}
    out = {}
    for token_id in sorted(tokenizer.get_vocab().values()):
        text = tokenizer.decode([token_id])
        if text.startswith(" ") and text[1:] in words:
            out[token_id] = text
    return out


def shape_demo_weights(model, tokenizer) -> None:
    """The edits of the module docstring, on a freshly built (random) model."""
    with torch.no_grad():
        _words_only(_thinker_lm(model), model.thinker.lm_head.weight, tokenizer)
        _one_code_per_word(model, tokenizer)
        _distinct_voices(model, tokenizer)
        _codes_drive_the_sound(model.token2wav.code2wav_dit_model)
        _loud_enough(model.token2wav.code2wav_bigvgan_model)


def write_demo_deploy(out_dir: Path) -> None:
    from vllm_omni.config.checkpoint_deploy import CHECKPOINT_DEPLOY_FILE

    (out_dir / CHECKPOINT_DEPLOY_FILE).write_text(DEMO_DEPLOY)


def _thinker_lm(model):
    # transformers >= 5.2x nests the thinker's text model as thinker.model.language_model;
    # 5.17 (the GPU machine's) has it as thinker.model itself.
    return getattr(model.thinker.model, "language_model", model.thinker.model)


def _keep_coordinate(layers, coordinate: int) -> None:
    # Attention and MLP outputs add nothing to this residual coordinate: it keeps its input value.
    for layer in layers:
        layer.self_attn.o_proj.weight[coordinate].zero_()
        layer.mlp.down_proj.weight[coordinate].zero_()


def shape_text_demo_weights(model, tokenizer) -> None:
    """The text demo (`demo_model_path("qwen3")`, a causal LM with untied embeddings): words only."""
    with torch.no_grad():
        _words_only(model.model, model.lm_head.weight, tokenizer)


def _words_only(lm, head, tokenizer) -> None:
    """`lm`: the decoder (embed_tokens, layers, norm); `head`: its output rows, apart from the embeddings."""
    lm.embed_tokens.weight[:, _THINKER_CONST] = 1.0
    _keep_coordinate(lm.layers, _THINKER_CONST)
    lm.norm.weight[_THINKER_CONST] = 1.0
    allowed = torch.zeros(head.shape[0], dtype=torch.bool)
    allowed[list(demo_words(tokenizer))] = True
    head[:, _THINKER_CONST] = torch.where(allowed, 0.0, -WORD_ONLY_PENALTY)


def _one_code_per_word(model, tokenizer) -> None:
    thinker, talker = _thinker_lm(model), model.talker
    # Only the <tts_pad> embedding has the pad coordinate; the thinker's final norm zeroes it in
    # the hidden states it hands the talker, and codec embeddings (in the thinker's width) lack it.
    thinker.embed_tokens.weight[:, _THINKER_PAD] = 0.0
    thinker.embed_tokens.weight[tokenizer.convert_tokens_to_ids("<tts_pad>"), _THINKER_PAD] = _PAD_VALUE
    thinker.norm.weight[_THINKER_PAD] = 0.0
    talker.model.embed_tokens.weight[:, _THINKER_PAD] = 0.0
    proj = talker.thinker_to_talker_proj
    proj.weight[:, _THINKER_PAD] = 0.0
    proj.weight[[_TALKER_CONST, _TALKER_PAD]] = 0.0
    proj.weight[_TALKER_PAD, _THINKER_PAD] = 1.0
    proj.bias[_TALKER_PAD] = 0.0
    proj.bias[_TALKER_CONST] = _TALKER_CONST_VALUE
    _keep_coordinate(talker.model.layers, _TALKER_CONST)
    _keep_coordinate(talker.model.layers, _TALKER_PAD)
    talker.model.norm.weight[[_TALKER_CONST, _TALKER_PAD]] = 1.0
    cfg = model.config.talker_config
    head = talker.codec_head.weight
    head[:, [_TALKER_CONST, _TALKER_PAD]] = 0.0
    for stop in (cfg.tts_codec_end_token_id, cfg.tts_codec_pad_token_id):
        head[stop] = 0.0
        head[stop, _TALKER_CONST] = -_STOP_WEIGHT
    head[cfg.tts_codec_end_token_id, _TALKER_PAD] = _STOP_WEIGHT


def _distinct_voices(model, tokenizer) -> None:
    # The talker sees a voice only in its speaker's bos row, one position among the whole prompt:
    # through attention spread over the prompt, random rows barely move its codes, and both voices
    # would speak the same ones. A coordinate only the speakers' bos rows set feeds one key
    # dimension, which every query (by its bias) weighs heavily: each position then attends to
    # its voice's row. The key sits in the slowest rotary pair, so it looks the same from any
    # distance.
    from vllm_omni.testing.tiny_omni import SPEAKER_BOS_TOKENS

    thinker, talker = _thinker_lm(model), model.talker
    embed = thinker.embed_tokens.weight
    embed[:, _THINKER_VOICE] = 0.0
    for token in SPEAKER_BOS_TOKENS.values():
        embed[tokenizer.convert_tokens_to_ids(token), _THINKER_VOICE] = _VOICE_MARK
    thinker.norm.weight[_THINKER_VOICE] = 0.0
    talker.model.embed_tokens.weight[:, _THINKER_VOICE] = 0.0
    proj = talker.thinker_to_talker_proj
    proj.weight[:, _THINKER_VOICE] = 0.0
    proj.weight[_TALKER_VOICE] = 0.0
    proj.weight[_TALKER_VOICE, _THINKER_VOICE] = 1.0
    proj.bias[_TALKER_VOICE] = 0.0
    attn = talker.model.layers[0].self_attn
    head_dim = model.config.talker_config.head_dim
    key = head_dim // 2 - 1  # the slowest rotary frequency
    attn.k_proj.weight[key] = 0.0
    attn.k_proj.weight[key, _TALKER_VOICE] = _VOICE_KEY
    attn.k_proj.bias[key] = 0.0
    attn.v_proj.weight[:, _TALKER_VOICE] = 0.0  # what a voice's row gives is its own part alone
    for head in range(model.config.talker_config.num_attention_heads):
        attn.q_proj.weight[head * head_dim + key] = 0.0
        attn.q_proj.bias[head * head_dim + key] = _VOICE_QUERY


def _codes_drive_the_sound(dit) -> None:
    # The random DiT's log-mel is N(0, 1.2), where the vocoder's input normalization (-115..+1
    # dB) maps it to a narrow band around one value: the waveform is then mostly the vocoder's
    # response to that constant (two random code sequences differ by 10%). Centre the mel in
    # that range (-4.3: the middle, in natural-log units) and widen it, with the codes' share
    # of the DiT input tripled: code sequences then differ by ~80% in the waveform (measured).
    dit.text_embed.codec_embed.weight.mul_(_CODE_EMBED_GAIN)
    dit.proj_out.weight.mul_(_MEL_GAIN)
    dit.proj_out.bias.mul_(_MEL_GAIN).add_(_MEL_CENTRE)


def _loud_enough(bigvgan) -> None:
    # Its last convolution is linear up to the final clamp: this gain is the waveform's
    # (measured after it: rms 0.06, peak 0.33, -24 dBFS, no clipping).
    bigvgan.conv_post.weight.mul_(_VOCODER_GAIN)
    if bigvgan.conv_post.bias is not None:
        bigvgan.conv_post.bias.mul_(_VOCODER_GAIN)
