"""Qwen3-TTS speech socket (/v1/audio/speech/stream): text written at a pace, speech as it streams.

Starts `vllm-omni serve` on the checkpoint (the tiny one on CPU by default; --real-arch: the
released 1.7B CustomVoice architecture with random weights, as bench_tts.py), then, for each
--max-frames-per-token value, runs --sessions sessions one after another: a client writes the
text word by word at --chars-per-s (~15: speaking pace; 0: all at once), then input_text.end,
and plays the audio in real time from its first chunk.

Reported per value, over the sessions:
- first audio after the first phrase boundary: from sending the piece that completes the first
  boundary (punctuation and the space after it: where the server can start) to the first chunk;
- gaps: the audio runs dry before the next chunk arrives (sessions with a gap, gaps per session,
  total and longest);
- the audio's length, and how long after the text's end its last chunk came.
Random weights never stop early (ignore_eos): each session makes --frames-per-token frames per
text token, about the released models' pace of speech.

    python benchmarks/bench_tts_stream.py                          # tiny checkpoint, CPU smoke run
    python benchmarks/bench_tts_stream.py --real-arch --sessions 10 --max-frames-per-token 0,4
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_tts import real_arch_checkpoint, tiny_checkpoint  # benchmarks/ (the script's folder)

TEXT = ("Good morning, and welcome to the show. Today we talk about the sea, the sky and the long road "
        "between them. The weather is fine, so we walk to the harbour first. Boats come and go all day; "
        "the fishermen wave as they pass. Later we climb the hill to see the town from above.")
SAMPLE_RATE, SAMPLES_PER_FRAME = 24000, 1920


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Qwen3-TTS CustomVoice checkpoint directory (default: build the tiny one)")
    p.add_argument("--real-arch", action="store_true", help="the released 1.7B architecture, random weights")
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--chars-per-s", type=float, default=15.0, help="the client's writing pace (0: all at once)")
    p.add_argument("--max-frames-per-token", default="0,4",
                   help="comma-separated session values: 0 waits for text, N goes on with pads (docs/tts.md)")
    p.add_argument("--frames-per-token", type=float, default=4.0, help="frames made per text token (speech length)")
    p.add_argument("--voice", default="vivian")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, real_arch: bool, port: int, log: Path) -> subprocess.Popen:
    import torch

    talker: dict[str, Any] = {"default_sampling_params": {"ignore_eos": True, "max_tokens": 2048}}
    code2wav: dict[str, Any] = {}
    if torch.cuda.is_available():
        talker["dtype"] = "bfloat16"
    if real_arch:
        talker["load_format"] = code2wav["load_format"] = "dummy"
    cmd = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", str(model), "--served-model-name", "tts",
           "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning",
           "--stage-overrides", json.dumps({"0": talker, "1": code2wav})]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    import httpx

    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not start")


async def session(port: int, args: argparse.Namespace, per_token: float, tokens: int) -> dict[str, Any]:
    import websockets

    from vllm_omni.entrypoints.openai.speech_stream_protocol import PhraseCutter

    pieces = [w + " " for w in TEXT.split(" ")]
    out: dict[str, Any] = {"boundary_at": None, "text_done_at": None, "chunks": []}
    sampling = {"max_tokens": int(args.frames_per_token * tokens)}
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/audio/speech/stream", max_size=None) as ws:
        await ws.recv()
        await ws.send(json.dumps({"type": "session.update", "session": {
            "voice": args.voice, "max_frames_per_token": per_token, "sampling": sampling}}))

        async def write() -> None:
            sent = ""
            for piece in pieces:
                await ws.send(json.dumps({"type": "input_text.append", "text": piece}))
                sent += piece
                if out["boundary_at"] is None and PhraseCutter().cut(sent) > 0:
                    out["boundary_at"] = time.perf_counter()
                if args.chars_per_s:
                    await asyncio.sleep(len(piece) / args.chars_per_s)
            out["text_done_at"] = time.perf_counter()
            await ws.send(json.dumps({"type": "input_text.end"}))

        writer = asyncio.create_task(write())
        async for message in ws:
            event = json.loads(message)
            if event["type"] == "speech.audio.delta":
                out["chunks"].append((time.perf_counter(), len(base64.b64decode(event["audio"])) // 2))
            elif event["type"] == "error":
                raise RuntimeError(event["error"]["message"])
        await writer
    return out


def playback(chunks: list[tuple[float, int]]) -> list[float]:
    """The gaps (s) of real-time playback from the first chunk: a chunk that arrives after the
    audio before it has played out."""
    gaps, end = [], None
    for arrived, samples in chunks:
        if end is not None and arrived > end:
            gaps.append(arrived - end)
        end = max(end or arrived, arrived) + samples / SAMPLE_RATE
    return gaps


def summarize(per_token: float, runs: list[dict[str, Any]]) -> dict[str, Any]:
    first = [r["chunks"][0][0] - r["boundary_at"] for r in runs]
    gaps = [playback(r["chunks"]) for r in runs]
    audio = [sum(n for _, n in r["chunks"]) / SAMPLE_RATE for r in runs]
    tail = [r["chunks"][-1][0] - r["text_done_at"] for r in runs]
    row = {"max_frames_per_token": per_token, "sessions": len(runs),
           "first_audio_after_boundary_ms": {"p50": 1e3 * statistics.median(first), "max": 1e3 * max(first)},
           "sessions_with_gaps": sum(1 for g in gaps if g), "gaps_per_session": statistics.mean(len(g) for g in gaps),
           "gap_total_s": sum(sum(g) for g in gaps) / len(runs), "gap_longest_s": max((max(g) for g in gaps if g),
                                                                                       default=0.0),
           "audio_s": statistics.mean(audio), "last_audio_after_text_s": statistics.mean(tail)}
    print(f"max_frames_per_token {per_token:g}: first audio after the first boundary p50 "
          f"{row['first_audio_after_boundary_ms']['p50']:.1f} ms (max {row['first_audio_after_boundary_ms']['max']:.1f})"
          f" | gaps: {row['sessions_with_gaps']}/{len(runs)} sessions, {row['gaps_per_session']:.1f} per session, "
          f"{row['gap_total_s']:.2f} s per session, longest {row['gap_longest_s']:.2f} s | audio {row['audio_s']:.1f} s, "
          f"last chunk {row['last_audio_after_text_s']:.2f} s after the text", flush=True)
    return row


def main() -> None:
    args = parse_args()
    # A time limit's SIGTERM unwinds (the finally below stops the server, which has its own session).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model = Path(args.model)
        elif args.real_arch:
            model = real_arch_checkpoint(Path(tmp) / "real")
        else:
            model = tiny_checkpoint("CustomVoice", Path(tmp) / "tiny")
        from transformers import AutoTokenizer

        tokens = len(AutoTokenizer.from_pretrained(str(model)).encode(TEXT))
        port = free_port()
        log = Path(args.json).with_suffix(".server.log") if args.json else Path(tmp) / "server.log"
        server = start_server(model, args.real_arch, port, log)
        rows = []
        try:
            asyncio.run(session(port, args, 0.0, tokens))  # warm-up
            for per_token in (float(v) for v in args.max_frames_per_token.split(",") if v):
                runs = [asyncio.run(session(port, args, per_token, tokens)) for _ in range(args.sessions)]
                rows.append(summarize(per_token, runs))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))


if __name__ == "__main__":
    main()
