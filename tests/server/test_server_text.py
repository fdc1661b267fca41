"""The API server on a tiny text-only LLM: completions, chat, admission (429), disconnects,
413, and a dead stage (503). The server admits one request at a time with a one-slot queue and
a 2 s admission deadline, so overload is cheap to provoke."""
from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest

from tests.pipeline.conftest import wait_until
from tests.server.conftest import ServerProcess

NAME = "tiny-qwen3"
MAX_MODEL_LEN = 4096
MAX_BODY = 200_000
LONG = {"max_tokens": 4000, "ignore_eos": True}  # runs for many seconds on the tiny model


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("text-server")
    srv = ServerProcess.launch(
        [str(tiny_model("qwen3")), "--served-model-name", NAME, "--max-model-len", str(MAX_MODEL_LEN),
         "--max-num-seqs", "4", "--max-concurrent-requests", "1", "--max-queued-requests", "1",
         "--batch-timeout", "2", "--max-request-bytes", str(MAX_BODY), "--log-file", str(tmp / "server.log"), "--log-stats"],
        tmp / "stdout.log")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_health_version_and_log_file(server, tmp_path_factory):
    assert [m["id"] for m in server.get("/v1/models").json()["data"]] == [NAME]
    health = server.get("/health").json()
    assert health["status"] == "ok" and [s["state"] for s in health["stages"]] == ["up"]
    assert server.get("/version").json()["version"]
    log_file = next(tmp_path_factory.getbasetemp().glob("text-server*/server.log"))
    assert "serving" in log_file.read_text()


def test_completions_string_ids_and_batch(client, server):
    text = client.completions.create(model=NAME, prompt="Hello there", max_tokens=12, temperature=0)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 12
    # The same prompt as token ids (the server tokenizes strings without special tokens).
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(server.get("/v1/models").json()["data"][0]["root"]).encode(
        "Hello there", add_special_tokens=False)
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text
    batch = client.completions.create(model=NAME, prompt=["Hello there", "Other prompt"], max_tokens=12,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == text.choices[0].text
    assert batch.usage.completion_tokens == 24


def test_completions_stream_equals_non_stream(client):
    full = client.completions.create(model=NAME, prompt="Once upon", max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=NAME, prompt="Once upon", max_tokens=16, temperature=0,
                                            stream=True))
    assert len(chunks) > 2  # deltas, not one blob
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_text_seed_and_stream(client):
    msgs = [{"role": "user", "content": "Tell me a story"}]
    a = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=1.0, seed=7)
    b = client.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=10, temperature=1.0, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert len(a.choices) == 1 and a.usage.prompt_tokens > 0 and 0 < a.usage.completion_tokens <= 10
    stream = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=1.0, seed=7,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == a.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == a.usage.completion_tokens


@pytest.mark.parametrize("body, match", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n=1"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, "unsupported parameter 'tools'"),
    ({"messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"]}, "cannot output"),
    ({"messages": [{"role": "user", "content": "hi"}], "sampling_params_list": [{}, {}]}, "1 stages"),
    ({"messages": [{"role": "user", "content": "hi"}], "sampling_params_list": [{"top_p": 7}]}, "top_p"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}]}]},
     "text only"),
    ({"messages": [{"role": "user", "content": [{"type": "sticker", "id": 1}]}]}, "unknown content part"),
])
def test_bad_chat_requests_are_400(server, body, match):
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and match in err["message"]


def test_invalid_json_unknown_model_and_too_long(server, client):
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.APIStatusError, match="max_model_len") as e:
        client.completions.create(model=NAME, prompt=[11] * (MAX_MODEL_LEN + 5), max_tokens=2)
    assert e.value.status_code == 413
    assert client.completions.create(model=NAME, prompt="still serving", max_tokens=2).choices[0].text is not None


def test_request_body_over_the_limit_is_413(server):
    big = {"model": NAME, "prompt": "x" * MAX_BODY, "max_tokens": 1}
    r = server.post("/v1/completions", big)  # Content-Length says it all
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    payload = __import__("json").dumps(big).encode()
    chunked = (payload[i:i + 65536] for i in range(0, len(payload), 65536))  # no Content-Length
    r = httpx.post(f"{server.url}/v1/completions", content=chunked, timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_overload_is_429_and_disconnects_free_the_slot(server):
    """One slot, one queue place, 2 s admission deadline."""
    with httpx.Client(timeout=30) as http, concurrent.futures.ThreadPoolExecutor(2) as pool:
        body = {"model": NAME, "prompt": "long", "stream": True, **LONG}
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as holder:
            assert holder.status_code == 200
            lines = holder.iter_lines()  # keep it: dropping the iterator would close the connection
            next(lines)  # admitted and generating
            queued = pool.submit(_timed_post, server, {"model": NAME, "prompt": "queued", "max_tokens": 2})
            assert wait_until(lambda: server.metric("vllm_omni:num_requests_waiting") == 1.0, 10.0)
            r = server.post("/v1/completions", {"model": NAME, "prompt": "rejected", "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["type"] == "RateLimitError"
            assert "at its limit" in r.json()["error"]["message"]  # the queue is full: rejected at once
            status, waited, body = queued.result(10)
            assert status == 429 and waited >= 1.9  # the admission deadline (--batch-timeout 2)
            assert "no free slot within 2.0 s" in body["error"]["message"]
            assert server.metric("vllm_omni:stage_num_requests", stage="0") == 1.0  # still generating
        # Leaving the `with` closed the stream: the request must be aborted in the stage.
        assert wait_until(lambda: server.metric("vllm_omni:stage_num_requests", stage="0") == 0.0, 10.0)
        assert server.metric("vllm_omni:num_requests_running") == 0.0
        r = server.post("/v1/completions", {"model": NAME, "prompt": "after", "max_tokens": 2}, timeout=10)
        assert r.status_code == 200


def test_non_streaming_disconnect_aborts_the_request(server):
    before = server.metric("vllm_omni:requests_total", endpoint="/v1/completions", status="499") or 0.0
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", {"model": NAME, "prompt": "long", **LONG}, timeout=1.5)
    assert wait_until(lambda: server.metric("vllm_omni:stage_num_requests", stage="0") == 0.0, 10.0)
    assert wait_until(lambda: server.metric("vllm_omni:requests_total", endpoint="/v1/completions",
                                            status="499") == before + 1, 10.0)
    assert server.post("/v1/completions", {"model": NAME, "prompt": "after", "max_tokens": 2}).status_code == 200


def test_a_max_tokens_the_context_cannot_hold_is_vllms_400(server):
    """vLLM's rule (docs/compatibility.md, "max_tokens"): the request's own max_tokens must fit
    max_model_len after its prompt; a default is not a cap."""
    r = server.post("/v1/completions", {"model": NAME, "prompt": [11] * 100, "max_tokens": MAX_MODEL_LEN - 99})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: {MAX_MODEL_LEN - 99}. This model's maximum context "
        f"length is {MAX_MODEL_LEN} tokens and your request has 100 input tokens ({MAX_MODEL_LEN - 99} > "
        f"{MAX_MODEL_LEN} - 100).")
    fits = server.post("/v1/completions", {"model": NAME, "prompt": [11] * 100, "max_tokens": 2})
    assert fits.status_code == 200, fits.text


def test_dead_stage_is_503_and_health_names_it(server):
    """Last in the module: it kills the server's only stage."""
    import os
    import signal

    os.kill(server.stage_pids[0], signal.SIGKILL)
    assert wait_until(lambda: server.get("/health").status_code == 503, 15.0)
    health = server.get("/health").json()
    # It is being restarted (tests/reliability covers the rest): clients are told when to retry.
    assert "stage 0" in health["error"]["message"] and health["stages"][0]["state"] == "restarting"
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and "stage 0" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 1
    r = server.post("/v1/completions", {"prompt": "hi"})
    assert r.status_code == 503
    assert server.get("/v1/models").status_code == 200  # the server itself keeps answering


def _timed_post(server, body):
    t0 = time.monotonic()
    r = server.post("/v1/completions", body, timeout=30)
    return r.status_code, time.monotonic() - t0, r.json()
