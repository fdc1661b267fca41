"""A user moving from upstream vLLM-Omni: `vllm serve MODEL --omni` with upstream's flags and an
upstream-format stage config (our copy of v0.12's bundled Qwen3-Omni YAML), driven by the
request shapes of upstream's examples, curl scripts and e2e tests, through the official
`openai` client and raw HTTP. Tiny Qwen3-Omni checkpoint, real server, real stages (threads of
the server).

Ends with an fps sweep: videos at real frame rates and lengths (29.97 fps, 1 s clips, ...)
with speech out, every one answered with its text and its audio.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
from fractions import Fraction

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from tests.compat.test_config_compat import V012
from tests.conftest import in_threads
from tests.multimodal.media_files import mp4_bytes
from tests.server.conftest import ServerProcess
from vllm_omni.multimodal.qwen3_omni_chat_template import QWEN3_OMNI_CHAT_TEMPLATE

NAME = "Qwen/Qwen3-Omni-30B-A3B-Instruct"  # served under upstream's name, as its clients ask
SYSTEM = "You are Qwen, a virtual human."
# Upstream's --chat-template use: the model's template with a default system turn of one's own.
TEMPLATE = ("{%- if messages[0]['role'] != 'system' -%}{{- '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' -}}"
            "{%- endif -%}" + QWEN3_OMNI_CHAT_TEMPLATE)
SMALL_FRAMES = {"min_pixels": 32 * 32, "max_pixels": 4 * 32 * 32}
NTSC = Fraction(30000, 1001)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("compat-qwen3-server")
    (folder / "template.jinja").write_text(TEMPLATE)
    proc = ServerProcess.launch([
        str(tiny_model("qwen3_omni_moe")), "--omni", "--served-model-name", NAME,
        "--stage-configs-path", str(V012), "--init-sleep-seconds", "20", "--disable-log-requests",
        "--no-async-chunk", "--limit-mm-per-prompt", '{"video": 1, "image": 2}',
        "--chat-template", str(folder / "template.jinja"), "--audio-stream-shape", "upstream",
        "--stage-overrides", json.dumps(in_threads(3)),
    ], folder / "server.log", entry="vllm")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("qwen3_omni_moe"))


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def text(s: str) -> dict:
    return {"type": "text", "text": s}


def video_part(fps: Fraction, seconds: float, with_audio: bool = False, **options) -> dict:
    data = mp4_bytes(n_frames=round(fps * seconds), fps=fps, size=(64, 64), with_audio=with_audio)
    url = f"data:video/mp4;base64,{base64.b64encode(data).decode()}"
    return {"type": "video_url", "video_url": {"url": url}, **options}


def wav(b64: str) -> np.ndarray:
    samples, rate = sf.read(io.BytesIO(base64.b64decode(b64)), dtype="int16")
    assert rate == 24000 and samples.ndim == 1
    return samples


def test_upstream_flags_start_the_server(server):
    log = server.log_path.read_text()
    assert "--init-sleep-seconds is deprecated and ignored" in log and "--disable-log-requests is deprecated" in log
    assert "engine_args.hf_config_name (stages 0, 1, 2)" in log  # the stage config's ignored keys, one warning
    stages = server.get("/health").json()["stages"]
    assert [s["model_stage"] for s in stages] == ["thinker", "talker", "code2wav"]


def test_upstream_example_client_request(client):
    """openai_chat_completion_client_for_multimodal_generation.py: per-stage sampling params in
    extra_body (its values, with small max_tokens for the tiny model), text and speech back."""
    thinker = {"temperature": 0.4, "top_p": 0.9, "top_k": 1, "max_tokens": 6, "repetition_penalty": 1.05,
               "stop_token_ids": [151645], "seed": 42}
    talker = {"temperature": 0.9, "top_k": 50, "max_tokens": 12, "seed": 42, "detokenize": False,
              "repetition_penalty": 1.05, "stop_token_ids": [2150]}
    code2wav = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_tokens": 4096 * 16, "seed": 42,
                "detokenize": True, "repetition_penalty": 1.1}
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "system", "content": [text(SYSTEM)]}, *user(text("Explain in 15 words."))],
        extra_body={"sampling_params_list": [thinker, talker, code2wav]})
    speech = [c for c in out.choices if c.message.audio]
    texts = [c for c in out.choices if c.message.content]
    assert len(speech) == len(texts) == 1 and out.usage.completion_tokens == 6
    assert wav(speech[0].message.audio.data).size > 0


def test_upstream_curl_body_with_nested_extra_body(server):
    """run_curl_multimodal_generation.sh sends `"modalities": null` and `"mm_processor_kwargs": {}`;
    upstream's docs write an `"extra_body": {...}` object into the JSON by hand."""
    body = {"model": NAME, "modalities": None, "mm_processor_kwargs": {}, "messages": user(text("Hi")),
            "extra_body": {"modalities": ["text"], "max_tokens": 3, "request_id": "curl-1"}}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "chatcmpl-curl-1" and len(out["choices"]) == 1
    assert out["usage"]["completion_tokens"] == 3
    r = server.post("/v1/chat/completions", json={**body, "extra_body": ["not", "an", "object"]})
    assert r.status_code == 400 and "extra_body must be an object" in r.json()["error"]["message"]


def test_chat_template_flag_and_kwargs(client, tokenizer):
    """--chat-template replaces the model's template; chat_template_kwargs reach it
    (enable_thinking=False opens the reply with an empty think block)."""
    messages = user(text("Hello there"))

    def prompt_tokens(**kwargs) -> int:
        out = client.chat.completions.create(model=NAME, messages=messages, modalities=["text"], max_tokens=1,
                                             **kwargs)
        return out.usage.prompt_tokens

    def expected(template: str, **variables) -> int:
        rendered = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                                 tokenize=False, **variables)
        return len(tokenizer.encode(rendered, add_special_tokens=False))

    assert expected(TEMPLATE) != expected(QWEN3_OMNI_CHAT_TEMPLATE)  # the flag is visible in the prompt
    assert prompt_tokens() == expected(TEMPLATE)
    no_thinking = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert no_thinking == expected(TEMPLATE, enable_thinking=False) > expected(TEMPLATE)
    with pytest.raises(openai.BadRequestError, match=r"chat_template_kwargs may not set \['tokenize'\]"):
        prompt_tokens(extra_body={"chat_template_kwargs": {"tokenize": True}})


def test_logprobs_of_the_text_stage(client, server, tokenizer):
    greedy = [{"repetition_penalty": 1.0}, None, None]  # raw-logit argmax is then the sampled token
    out = client.chat.completions.create(model=NAME, messages=user(text("Tell me a story")), modalities=["text"],
                                         logprobs=True, top_logprobs=3, extra_body={"sampling_params_list": greedy})
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    for t in content:
        tops = [a.logprob for a in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)
    plain = client.chat.completions.create(model=NAME, messages=user(text("Tell me a story")), modalities=["text"],
                                           extra_body={"sampling_params_list": greedy})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content
    # Tokens that are whole characters (the random model otherwise picks partial UTF-8 bytes): the
    # logprobs' tokens then spell the reply, in both APIs.
    ascii_ids = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).isascii() and tokenizer.decode([i]).strip()]
    spelled = [{"allowed_token_ids": ascii_ids}, None, None]
    out = client.chat.completions.create(model=NAME, messages=user(text("Tell me a story")), modalities=["text"],
                                         logprobs=True, extra_body={"sampling_params_list": spelled})
    content = out.choices[0].logprobs.content
    assert "".join(t.token for t in content) == out.choices[0].message.content
    assert all(t.top_logprobs == [] and t.bytes == list(t.token.encode()) for t in content)
    legacy = server.post("/v1/completions", json={"model": NAME, "prompt": "Once upon", "max_tokens": 4,
                                                  "logprobs": 2, "sampling_params_list": spelled})
    choice = legacy.json()["choices"][0]
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    # Two alternatives per token (fewer when two decode to the same text: the legacy shape keys them by text).
    assert len(choice["logprobs"]["top_logprobs"]) == 4 and all(
        1 <= len(t) <= 2 and max(t.values()) <= 0 for t in choice["logprobs"]["top_logprobs"])


@pytest.mark.parametrize("extra, status, match", [
    ({"response_format": {"type": "text"}}, 200, None),
    ({"response_format": {"type": "json_object"}}, 400, "response_format type 'json_object' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, 400,
     "response_format type 'json_schema' is not supported: structured output"),
    ({"priority": 0}, 200, None),
    ({"priority": 5}, 400, "priority 5 is not supported: priority scheduling is not enabled"),
    ({"top_logprobs": 2}, 400, "top_logprobs needs logprobs: true"),
])
def test_request_fields(server, extra, status, match):
    r = server.post("/v1/chat/completions", json={"model": NAME, "messages": user(text("Hi")),
                                                  "modalities": ["text"], "max_tokens": 2, **extra})
    assert r.status_code == status, r.text
    if match:
        assert match in r.json()["error"]["message"]


def test_request_id_names_the_response(client, server):
    out = client.chat.completions.create(model=NAME, messages=user(text("Hi")), modalities=["text"], max_tokens=2,
                                         extra_body={"request_id": "my-request-7"})
    assert out.id == "chatcmpl-my-request-7"
    r = server.post("/v1/chat/completions", json={"model": NAME, "messages": user(text("Hi")), "max_tokens": 2,
                                                  "modalities": ["text"]}, headers={"X-Request-Id": "from-header"})
    assert r.json()["id"] == "chatcmpl-from-header"  # vLLM's rule: the header wins


def test_sampling_precedence_follows_upstream(client):
    """The thinker's YAML says top_k 1 (temperature 0.4, seed 42): a request's top_k or
    repetition_penalty leaves it in place (upstream's test_yaml_custom_params_not_overridden_by_
    request); sampling_params_list sets it; max_tokens is on upstream's list and applies."""
    def reply(**kwargs) -> str:
        out = client.chat.completions.create(model=NAME, messages=user(text("Tell me about cats")),
                                             modalities=["text"], **kwargs)
        return out.choices[0].message.content

    yaml = reply()
    assert reply(extra_body={"top_k": 50, "repetition_penalty": 1.8}) == yaml
    assert reply(extra_body={"sampling_params_list": [{"top_k": 50}, None, None]}) != yaml
    short = client.chat.completions.create(model=NAME, messages=user(text("Tell me about cats")), max_tokens=3,
                                           modalities=["text"])
    assert short.usage.completion_tokens == 3 and yaml.startswith(short.choices[0].message.content)


def test_video_url_num_frames_both_forms(client):
    def prompt_tokens(part: dict) -> int:
        out = client.chat.completions.create(model=NAME, messages=user(part, text("What happens?")),
                                             modalities=["text"], max_tokens=1,
                                             extra_body={"mm_processor_kwargs": SMALL_FRAMES})
        return out.usage.prompt_tokens

    clip = video_part(Fraction(30), 2.0)
    nested = {**clip, "video_url": {**clip["video_url"], "num_frames": 8}}
    sibling = {**clip, "num_frames": 8}
    default = prompt_tokens(clip)  # 2 frames per second: 4 frames, 2 frame groups
    assert prompt_tokens(nested) == prompt_tokens(sibling) > default


def test_limit_mm_per_prompt(client):
    clip = video_part(Fraction(30), 1.0)
    with pytest.raises(openai.BadRequestError, match=r"at most 1 video\(s\) may be provided in one prompt, got 2"):
        client.chat.completions.create(model=NAME, messages=user(clip, clip, text("Compare.")), max_tokens=1)


def test_upstream_streaming_shape(server):
    """--audio-stream-shape upstream: audio chunks carry the base64 file in delta.content, marked
    modality "audio"; text chunks are unchanged."""
    body = {"model": NAME, "messages": user(text("Hello")), "stream": True}
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    audio = [c for c in chunks if c.get("modality") == "audio"]
    texts = [c for c in chunks if c.get("modality") == "text"]
    assert audio and texts
    assert all("audio" not in c["choices"][0]["delta"] for c in audio)
    samples = np.concatenate([wav(c["choices"][0]["delta"]["content"]) for c in audio
                              if c["choices"][0]["delta"].get("content")])
    assert samples.size > 0 and audio[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in texts)


# Frame rates and lengths of real videos, each with speech out; the 1 s and 29.97 fps ones put
# frames at fractional M-RoPE times. Two keep their audio track (use_audio_in_video).
SWEEP = [(fps, seconds, False) for fps in (NTSC, Fraction(30), Fraction(25), Fraction(24000, 1001), Fraction(60))
         for seconds in (0.5, 1.0, 1.5, 2.0)] + [(NTSC, 1.0, True), (Fraction(25), 3.0, True)]


def test_fps_sweep_video_in_speech_out(server):
    async def one(aclient, fps, seconds, with_audio):
        mm = {**SMALL_FRAMES, "use_audio_in_video": with_audio}
        return await aclient.chat.completions.create(
            model=NAME, messages=user(video_part(fps, seconds, with_audio), text("Describe it.")),
            modalities=["text", "audio"], extra_body={"mm_processor_kwargs": mm})

    async def sweep():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0,
                                      timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, *clip) for clip in SWEEP))

    for clip, out in zip(SWEEP, asyncio.run(sweep()), strict=True):
        text_choice, speech = out.choices
        assert text_choice.message.content and out.usage.completion_tokens == 8, clip
        assert speech.finish_reason == "stop" and wav(speech.message.audio.data).size > 0, clip
