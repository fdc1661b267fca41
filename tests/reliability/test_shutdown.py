"""SIGTERM under load: admission stops (503), short requests finish, the ones still running
after --shutdown-timeout end with OpenAI-shaped errors (an SSE error event then [DONE] for a
stream), and nothing is left behind: no process, shared memory, IPC folder or traceback.
(Ctrl-C takes the same path: the package's shared server is stopped with SIGINT and checked
the same way, see conftest.stop_cleanly.)"""
from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from tests.conftest import in_threads
from tests.pipeline.conftest import pid_alive, wait_until
from tests.reliability.conftest import NAME, OVERRIDES, launch

SHUTDOWN_TIMEOUT_S = 8.0
# Speech of 4000 talker codes takes far longer than the shutdown timeout on a CPU (two of them
# took 12 s at 2048 codes with token2wav streaming beside the talker; max_model_len is 4096).
LONG_CODES = 4000
LONG_SPEECH = [None, {"max_tokens": LONG_CODES, "ignore_eos": True}, None]
OVERRIDES_LONG = {**OVERRIDES, "1": {**OVERRIDES["1"], "max_tokens_limit": LONG_CODES}}


def _launch(fault_model, tmp_path, overrides: dict):
    proc = launch(tmp_path, fault_model, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), overrides=overrides)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture
def server(fault_model, tmp_path):
    """Real stage processes: the SIGTERM test checks that none outlives the server."""
    yield from _launch(fault_model, tmp_path, OVERRIDES_LONG)


@pytest.fixture
def threaded_server(fault_model, tmp_path):
    """The stages as threads of the server: the second Ctrl-C is the server's own signal handling
    (the first test covers the stage processes' shutdown), and one process starts in seconds."""
    yield from _launch(fault_model, tmp_path, in_threads(3, OVERRIDES_LONG))


def _post(url: str, body: dict, out: dict, key: str, started: threading.Event) -> None:
    """POST, keeping the response; a stream's text is read line by line and `started` is set at
    its first event (the request was admitted)."""
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={"model": NAME, **body}, timeout=120) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                started.set()
            out[key] = (r.status_code, "\n".join(lines))
    except httpx.HTTPError as e:  # a connection cut without an answer fails the test below
        out[key] = (None, repr(e))
    finally:
        started.set()


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_sigterm_under_load_answers_everyone_and_leaves_nothing(server):
    talk = [{"role": "user", "content": "Tell me everything."}]
    long = {"messages": talk, "sampling_params_list": LONG_SPEECH}
    longs = {"long": long, "long-stream": {**long, "stream": True}}
    shorts = {"short": {"messages": talk, "modalities": ["text"], "stream": True},  # finish within the timeout
              "speech": {"messages": talk, "stream": True}}
    out: dict[str, tuple] = {}
    started = {key: threading.Event() for key in (*longs, *shorts)}

    def start(bodies: dict) -> list[threading.Thread]:
        threads = [threading.Thread(target=_post, args=(server.url, body, out, key, started[key]))
                   for key, body in bodies.items()]
        for t in threads:
            t.start()
        return threads

    threads = start(longs)
    assert wait_until(lambda: server.metric("vllm_omni:num_requests_running") == len(longs), 60.0)
    threads += start(shorts)
    assert all(started[key].wait(60) for key in shorts)
    pid = server.proc.pid
    stage_pids = [s["pid"] for s in server.get("/health").json()["stages"]]
    server.proc.send_signal(signal.SIGTERM)
    # uvicorn acts on the signal at its next tick: from then on /health and new requests get 503.
    assert wait_until(lambda: server.get("/health").status_code == 503, 10.0)
    late = httpx.post(f"{server.url}/v1/chat/completions", json={"model": NAME, "messages": talk}, timeout=30)
    assert late.status_code == 503 and late.json()["error"]["message"] == "the server is shutting down"
    for t in threads:
        t.join(60)
    assert server.proc.wait(60) == 0

    for key in shorts:  # finished normally within the shutdown timeout
        status, text = out[key]
        assert status == 200 and _events(text)[-1] == "[DONE]" and '"error"' not in text, (key, text[-300:])
    assert '"audio"' in out["speech"][1]
    status, text = out["long"]
    # Its text was complete before the signal, so the answer is a partial 200 whose audio choice
    # carries the 503 (serving_chat.py); a request cut during its text gets a whole 503.
    body = json.loads(text)
    error = body["error"] if status == 503 else body["choices"][1]["error"]
    assert status in (200, 503) and error["message"].startswith("the server is shutting down") and error["code"] == 503, text
    if status == 200:
        assert body["choices"][0]["message"]["content"] and body["choices"][1]["finish_reason"] == "error"
    status, text = out["long-stream"]
    events = _events(text)
    assert status == 200 and events[-1] == "[DONE]" and "the server is shutting down" in events[-2]
    assert any('"content"' in e for e in events[:-2])  # it streamed its text before it was ended

    assert wait_until(lambda: not any(pid_alive(p) for p in stage_pids), 10.0)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"vomni-{pid}-")]
    assert not [n for n in os.listdir("/tmp") if n.startswith(f"vomni-{pid}-")]
    log = server.log_path.read_text()
    assert "Traceback" not in log and "ending 2 request(s) still in flight" in log


def test_a_second_ctrl_c_ends_the_wait_and_exits_cleanly(threaded_server):
    server = threaded_server
    talk = [{"role": "user", "content": "Tell me everything."}]
    out: dict[str, tuple] = {}
    started = threading.Event()
    thread = threading.Thread(target=_post, args=(server.url, {"messages": talk, "sampling_params_list": LONG_SPEECH},
                                                  out, "long", started))
    thread.start()
    assert wait_until(lambda: server.metric("vllm_omni:num_requests_running") == 1, 60.0)
    server.proc.send_signal(signal.SIGINT)
    assert wait_until(lambda: "waiting up to" in server.log_path.read_text(), 10.0)
    server.proc.send_signal(signal.SIGINT)  # do not wait for the request
    assert server.proc.wait(SHUTDOWN_TIMEOUT_S) == 0  # before the shutdown timeout would end it
    thread.join(30)
    assert out["long"][0] in (200, 503) and "the server is shutting down" in out["long"][1]
    log = server.log_path.read_text()
    assert "Traceback" not in log and "ending 1 request(s) still in flight" in log, log[-2000:]
