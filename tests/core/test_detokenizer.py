import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from vllm_omni.core.detokenizer import IncrementalDetokenizer
from vllm_omni.sampling_params import SamplingParams
from vllm_omni.testing.tokenizer import make_tiny_tokenizer

MULTIBYTE = "Hello 世界! 🤖 sings 👩‍👩‍👧 café. The end."
CHAT_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def cjk_tok():
    """Byte-level BPE trained on CJK/emoji, so some tokens hold the end of one character and
    the start of the next (a harder case than one byte per token)."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + 40, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    t.train_from_iterator(["世界你好世界再见中文字符"] * 20 + ["🤖🎉🤖🎉"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t)


def stream(tokenizer, text, params, prompt=CHAT_PROMPT, chunk=1):
    """Feed the ids of `text` `chunk` at a time; return the detokenizer, the deltas taken after
    each append, and the stop string (if any)."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), params)
    ids = tokenizer.encode(text)
    deltas, stop = [], None
    for i in range(0, len(ids), chunk):
        stop = detok.append(ids[i : i + chunk])
        deltas.append(detok.take_delta())
        if stop is not None:
            break
    deltas.append(detok.take_delta(final=True))
    return detok, deltas, stop


@pytest.mark.parametrize("chunk", [1, 3])
def test_multibyte_text_equals_full_decode(tok, chunk):
    ids = tok.encode(MULTIBYTE)
    # The test is only meaningful if characters really are split over tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok, deltas, stop = stream(tok, MULTIBYTE, SamplingParams(), chunk=chunk)
    assert stop is None
    assert detok.output_text == tok.decode(ids) == MULTIBYTE
    assert "".join(deltas) == MULTIBYTE
    assert all("\ufffd" not in d for d in deltas)


def test_tokens_spanning_character_boundaries(cjk_tok):
    text = "世界你好 🤖🎉 中文字符再见"
    ids = cjk_tok.encode(text)
    pieces = [cjk_tok.decode([i]) for i in ids]
    assert any(p.endswith("\ufffd") and p.strip("\ufffd") for p in pieces)  # e.g. "中" + half of "文"
    detok, deltas, _ = stream(cjk_tok, text, SamplingParams(), prompt="世界")
    assert detok.output_text == cjk_tok.decode(ids) == text
    assert "".join(deltas) == text


def test_empty_prompt_and_special_tokens(tok):
    ids = tok.encode("Hello there") + [tok.convert_tokens_to_ids("<|im_end|>")]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=skip))
        for i in ids:
            detok.append([i])
        assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert detok.output_text.endswith("<|im_end|>")


def test_prompt_context_keeps_leading_space():
    """A decoder that strips the leading space of the first token (sentencepiece style) must
    not strip it from the first OUTPUT token: the prompt is decoded as context."""
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    t.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"], show_progress=False)
    t.train_from_iterator(["Hello world, the sea and the sky."] * 10, trainer)
    sp = PreTrainedTokenizerFast(tokenizer_object=t)
    prompt, out = sp.encode("Hello"), sp.encode("Hello world, the sky")[len(sp.encode("Hello")) :]
    detok = IncrementalDetokenizer(sp, prompt, SamplingParams())
    for i in out:
        detok.append([i])
    assert detok.output_text == " world, the sky"


def test_stop_string_inside_a_token(tok):
    # "quick" is tokenized as "qu" + "ick": the stop string ends inside "ick".
    detok, deltas, stop = stream(tok, "The quick brown fox", SamplingParams(stop=["ic"]))
    assert stop == "ic"
    assert detok.output_text == "The qu"
    assert "".join(deltas) == "The qu"
    assert detok.finished


def test_stop_string_spanning_tokens(tok):
    detok, deltas, stop = stream(tok, "The quick brown fox jumps over", SamplingParams(stop=["k brown f"]))
    assert stop == "k brown f"
    assert detok.output_text == "The quic"
    assert "".join(deltas) == "The quic"


def test_include_stop_str_in_output(tok):
    params = SamplingParams(stop=["brown"], include_stop_str_in_output=True)
    detok, deltas, stop = stream(tok, "The quick brown fox jumps", params)
    assert stop == "brown"
    assert detok.output_text == "The quick brown"
    assert "".join(deltas) == "The quick brown"


def test_stop_string_in_multibyte_text(tok):
    detok, deltas, stop = stream(tok, MULTIBYTE, SamplingParams(stop=["界!"]))
    assert stop == "界!"
    assert detok.output_text == "Hello 世"
    assert "".join(deltas) == "Hello 世"


def test_earliest_stop_string_wins(tok):
    # Both end in the same appended chunk; the one that starts first cuts the text.
    detok, _, stop = stream(tok, "The quick brown fox", SamplingParams(stop=["fox", "quick"]), chunk=100)
    assert stop == "quick"
    assert detok.output_text == "The "


def test_several_ids_in_one_append_truncate_after_stop(tok):
    detok, _, stop = stream(tok, "The quick brown fox jumps", SamplingParams(stop=["own"]), chunk=100)
    assert stop == "own"
    assert detok.output_text == "The quick br"


def test_deltas_never_emit_a_partial_stop_string(tok):
    text = "She sells sea shells by the sea shore."
    stop_str = "the sea sh"
    detok = IncrementalDetokenizer(tok, tok.encode(CHAT_PROMPT), SamplingParams(stop=[stop_str, "xyz"]))
    emitted = ""
    for i in tok.encode(text):
        stop = detok.append([i])
        emitted += detok.take_delta()
        # Whatever was emitted is never taken back: it is a prefix of the final text.
        assert text.startswith(emitted)
        assert "the sea" not in emitted and not emitted.endswith("the")
        if stop:
            break
    assert stop == stop_str
    emitted += detok.take_delta(final=True)
    assert emitted == detok.output_text == "She sells sea shells by "


def test_hold_back_is_flushed_at_the_end(tok):
    detok, deltas, stop = stream(tok, "The quick brown fox", SamplingParams(stop=["never appears"]))
    assert stop is None
    # Until the end, the last len(stop)-1 characters were held back.
    assert len("".join(deltas[:-1])) == len("The quick brown fox") - len("never appears") + 1
    assert "".join(deltas) == detok.output_text == "The quick brown fox"


def test_min_tokens_text_cannot_hold_a_stop_string(tok):
    ids = tok.encode("The quick brown fox")  # The, ' ', qu, ick, ...
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["qu", "fo"], min_tokens=3))
    stops = []
    for i in ids:
        stops.append(detok.append([i]))
        if stops[-1]:
            break
    # "qu" is produced by the 3rd token (under min_tokens) and not found by the 4th either.
    assert stops[-1] == "fo" and set(stops[:-1]) == {None}
    assert detok.output_text == "The quick brown "


def test_stop_terminated_token_text_is_left_out(tok):
    ids = tok.encode("The quick")
    stop_id = tok.encode(" brown")[0]
    for include, want in ((False, "The quick"), (True, "The quick" + tok.decode([stop_id]))):
        detok = IncrementalDetokenizer(tok, [], SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=include))
        detok.append(ids)
        assert detok.append([stop_id], stop_terminated=True) is None
        assert detok.output_text == want
        assert detok.output_token_ids == ids + [stop_id]


def test_no_detokenize(tok):
    detok = IncrementalDetokenizer(tok, [1, 2], SamplingParams(detokenize=False))
    assert detok.append(tok.encode("The quick brown fox")) is None
    assert detok.output_text == "" and detok.take_delta(final=True) == ""
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
