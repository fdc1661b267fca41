"""A tiny Qwen-style tokenizer built offline (nothing is downloaded).

A byte-level BPE with ~400 learned tokens, trained on a few built-in sentences, plus the
special tokens of Qwen2/Qwen2.5-Omni/Qwen3-Omni, wrapped in `Qwen2TokenizerFast`. Byte-level
means any text round-trips through encode/decode, whatever the training corpus covered.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase, Qwen2TokenizerFast

# The standard Qwen ChatML layout, without Qwen2.5's default system prompt. List contents
# (OpenAI-style parts) contribute their text parts only; multimodal models pass their own
# template.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Order matters: ids are assigned in this order right after the learned vocabulary, so
# `<|endoftext|>` is the first special id, as in real Qwen tokenizers.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    # Qwen2.5-Omni
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    # Qwen3-Omni
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    # talker text side (both Omni generations)
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
]

# Named special tokens the Omni processors read (`tokenizer.image_token`, ...). The two model
# generations use different tokens for the same role, so the mapping is chosen per model.
QWEN2_5_OMNI_MM_TOKENS = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
QWEN3_OMNI_MM_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}

# Total size, a multiple of 64 so that the models' embedding tables (rounded up to 64) have no
# rows without a token: a random model samples every row, and an id the tokenizer does not
# know decodes to nothing (`convert_ids_to_tokens` gives None).
TOKENIZER_SIZE = 448
# Learned vocabulary, the 256 byte symbols included (~430 tokens).
BPE_VOCAB_SIZE = TOKENIZER_SIZE - len(SPECIAL_TOKENS)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How are you today? I am fine, thank you.",
    "What is the capital of France? The capital of France is Paris.",
    "Please write a short poem about the sea and the sky.",
    "Once upon a time there was a little girl who lived in a village near the forest.",
    "The weather is nice today, so we are going to the park.",
    "Can you tell me a story about a robot that learns to sing?",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Describe this image. Transcribe this audio. What happens in this video?",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "A journey of a thousand miles begins with a single step.",
    "The model generates text, speech and images from the prompt.",
    "You are a helpful assistant.",
    # Qwen3-Omni looks up `system`, `user` and `assistant` as single tokens: ChatML puts them
    # right after `<|im_start|>` (no leading space), so train them in that position, often.
    *(["system\nuser\nassistant\n"] * 50),
]


def make_tiny_tokenizer(
    mm_tokens: dict[str, str] | None = None,
    chat_template: str = CHATML_TEMPLATE,
) -> PreTrainedTokenizerBase:
    """Build the tiny tokenizer (a new object each call: training takes ~5 ms, no need to cache).

    `mm_tokens` names the multimodal special tokens (default: Qwen2.5-Omni's); the vocabulary
    and ids are the same whatever the mapping, so every tiny model shares one id layout.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # The same pipeline as real Qwen2 tokenizers: NFC, Qwen's split regex, byte-level symbols.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        # All 256 bytes, whether or not the corpus uses them: any text must be encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    # The corpus must be rich enough for the trainer to learn BPE_VOCAB_SIZE tokens.
    if tok.get_vocab_size() != TOKENIZER_SIZE:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, not {TOKENIZER_SIZE}")

    return Qwen2TokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=chat_template,
        extra_special_tokens=dict(mm_tokens or QWEN2_5_OMNI_MM_TOKENS),
    )
