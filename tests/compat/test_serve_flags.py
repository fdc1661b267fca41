"""vLLM's and upstream's serve flags: parsed, and a bad value stops `serve` before anything
loads (the served behaviour of each is in test_server_qwen3_omni_compat.py)."""
from __future__ import annotations

import pytest

from vllm_omni.entrypoints.cli.main import build_parser, main
from vllm_omni.entrypoints.openai.chat_options import ChatOptions, load_chat_template
from vllm_omni.entrypoints.openai.errors import APIError


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_upstream_and_vllm_flags_parse():
    args = parse("--init-sleep-seconds", "20", "--limit-mm-per-prompt", '{"image": 2, "video": {"count": 1}}',
                 "--enable-log-requests", "--disable-log-requests", "--no-async-chunk",
                 "--audio-stream-shape", "upstream")
    assert (args.init_sleep_seconds, args.limit_mm_per_prompt) == (20, {"image": 2, "video": 1})
    assert (args.enable_log_requests, args.disable_log_requests, args.async_chunk) == (True, True, False)
    assert args.audio_stream_shape == "upstream"
    assert parse().audio_stream_shape == "openai" and parse().enable_log_requests is False


@pytest.mark.parametrize("value, message", [
    ('{"vision": 1}', "unknown modality 'vision'; allowed: image, audio, video"),
    ('{"image": -1}', "image: the limit must be a count >= 0"),
    ("image=2", "not valid JSON"),
])
def test_bad_media_limits_are_refused_by_argparse(capsys, value, message):
    with pytest.raises(SystemExit):
        parse("--limit-mm-per-prompt", value)
    assert message in capsys.readouterr().err


def test_chat_template_file_or_text(tmp_path, capsys):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "t.jinja")) == load_chat_template(template) == template
    assert main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 1
    assert "looks like a file path but cannot be read" in capsys.readouterr().err
    assert main(["serve", "--chat-template", "{% for m in messages %}"]) == 1
    assert "--chat-template is not a valid Jinja template" in capsys.readouterr().err


def test_media_count_limit():
    options = ChatOptions(limit_mm_per_prompt={"image": 1, "audio": 0})
    image = {"type": "image_url", "image_url": {"url": "x"}}
    options.check_media_count([{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}])
    with pytest.raises(APIError, match=r"at most 1 image\(s\) may be provided in one prompt, got 2"):
        options.check_media_count([{"role": "user", "content": [image]}, {"role": "user", "content": [image]}])
    with pytest.raises(APIError, match=r"at most 0 audio\(s\)"):
        options.check_media_count([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
