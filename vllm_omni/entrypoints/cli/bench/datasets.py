"""The prompts a benchmark sends (`--dataset-name`), as vLLM's benchmark client draws them.

- `random`: `--random-prefix-len` fixed tokens, then a random context of `--random-input-len`
  tokens (+- `--random-range-ratio`), and an output length drawn the same way from
  `--random-output-len`. Token counts are exact with a tokenizer (`--tokenizer`, or `--model`
  when it is a local folder); without one a prompt is that many words.
- `random-mm`: `random` prompts with random images / audio attached to a chat message
  (`--random-mm-*`, upstream's flags).
- `sharegpt`: the first human turn of each conversation in `--dataset-path` (ShareGPT JSON).
- `custom`: one JSON object per line of `--dataset-path` with a `prompt` (and optional
  `output_tokens`).
"""
from __future__ import annotations

import ast
import base64
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATASETS = ("random", "random-mm", "sharegpt", "custom")
_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hum about jazz and "
          "music under bright summer skies near old stone bridges").split()


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens (words without a tokenizer); the server's usage wins when it reports one
    output_len: int | None  # None: the server's default
    mm_content: list[dict[str, Any]] = field(default_factory=list)  # chat content parts (random-mm)


def load_tokenizer(name: str | None) -> Any:
    """A local tokenizer, else None (prompts are counted in words)."""
    if name is None or not Path(name).expanduser().is_dir():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(name).expanduser()))


def sample_requests(args: Any, tokenizer: Any) -> list[SampleRequest]:
    rng = random.Random(args.seed)
    if args.dataset_name in ("random", "random-mm"):
        requests = [_random_request(args, tokenizer, rng) for _ in range(args.num_prompts)]
        if args.dataset_name == "random-mm":
            for request in requests:
                request.mm_content = _random_media(args, rng)
        return requests
    if args.dataset_path is None:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    prompts = _file_prompts(args.dataset_name, Path(args.dataset_path))
    if not prompts:
        raise ValueError(f"{args.dataset_path}: no prompts found")
    return [SampleRequest(text, _count(text, tokenizer), out if out is not None else args.sharegpt_output_len)
            for text, out in (prompts[i % len(prompts)] for i in range(args.num_prompts))]


def _lengths(base: int, ratio: float, rng: random.Random) -> int:
    return max(1, rng.randint(int(base * (1 - ratio)), int(base * (1 + ratio))))


def _random_request(args: Any, tokenizer: Any, rng: random.Random) -> SampleRequest:
    n = args.random_prefix_len + _lengths(args.random_input_len, args.random_range_ratio, rng)
    output_len = _lengths(args.random_output_len, args.random_range_ratio, rng)
    if tokenizer is None:
        return SampleRequest(" ".join(rng.choice(_WORDS) for _ in range(n)), n, output_len)
    vocab = tokenizer.vocab_size
    special = set(tokenizer.all_special_ids)
    ids = [i for i in (rng.randrange(vocab) for _ in range(4 * n)) if i not in special][:n]
    text = tokenizer.decode(ids)
    return SampleRequest(text, _count(text, tokenizer), output_len)


def _count(text: str, tokenizer: Any) -> int:
    return len(text.split()) if tokenizer is None else len(tokenizer(text, add_special_tokens=False).input_ids)


def _file_prompts(kind: str, path: Path) -> list[tuple[str, int | None]]:
    text = path.read_text(encoding="utf-8")
    if kind == "sharegpt":
        out = []
        for entry in json.loads(text):
            turns = entry.get("conversations") or []
            first = next((t.get("value") for t in turns if t.get("from") in ("human", "user")), None)
            if first:
                out.append((first, None))
        return out
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [(row["prompt"], row.get("output_tokens")) for row in rows]


# --- random-mm: images and audio (upstream's bucket keys: (height, width, frames); width 1 and
# height 0 is audio of `frames` seconds) -------------------------------------------------------

def parse_buckets(text: str) -> dict[tuple[int, int, int], float]:
    raw = ast.literal_eval(text) if isinstance(text, str) else text
    buckets = {tuple(ast.literal_eval(k) if isinstance(k, str) else k): float(v) for k, v in raw.items()}
    total = sum(buckets.values())
    if not buckets or total <= 0:
        raise ValueError("--random-mm-bucket-config needs at least one bucket with a positive probability")
    return {k: v / total for k, v in buckets.items()}


def _random_media(args: Any, rng: random.Random) -> list[dict[str, Any]]:
    buckets = parse_buckets(args.random_mm_bucket_config)
    limits = json.loads(args.random_mm_limit_mm_per_prompt)
    base, ratio = args.random_mm_base_items_per_request, args.random_mm_num_mm_items_range_ratio
    count = rng.randint(int(base * (1 - ratio)), max(int(base * (1 - ratio)), round(base * (1 + ratio))))
    count = min(count, sum(limits.values()))
    parts, used = [], {}
    for _ in range(count):
        allowed = {k: p for k, p in buckets.items() if used.get(_kind(k), 0) < limits.get(_kind(k), 0)}
        if not allowed:
            break
        key = rng.choices(list(allowed), weights=list(allowed.values()))[0]
        used[_kind(key)] = used.get(_kind(key), 0) + 1
        parts.append(_media_part(key, rng))
    return parts


def _kind(key: tuple[int, int, int]) -> str:
    height, width, frames = key
    return "audio" if height == 0 and width == 1 else "image" if frames == 1 else "video"


def _media_part(key: tuple[int, int, int], rng: random.Random) -> dict[str, Any]:
    kind = _kind(key)
    if kind == "video":
        raise ValueError("random-mm video buckets are not supported by this client (images and audio are)")
    if kind == "audio":
        import numpy as np
        import soundfile as sf

        buf = io.BytesIO()
        noise = np.random.default_rng(rng.randrange(2**32)).uniform(-0.1, 0.1, 16000 * key[2]).astype("float32")
        sf.write(buf, noise, 16000, format="WAV")
        url = "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()
        return {"type": "audio_url", "audio_url": {"url": url}}
    from PIL import Image

    height, width, _ = key
    image = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue())
                                                      .decode()}}
