"""What the talkers' streamed-input tests share: a thinker reply fed a row per thinker step, as
over a streaming edge (the bridge's start, then one StageInputChunk per step)."""
from __future__ import annotations

import torch

ROW_KEYS = ("thinker_embeds", "thinker_hidden")


def split_reply(info: dict, start: int) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """(the talker request's inputs with the thinker rows before `start`, the rows from `start`
    on as one-row chunks)."""
    reply = {key: info[key][start:] for key in ROW_KEYS}
    first = {**info, **{key: info[key][:start] for key in ROW_KEYS}}
    return first, [{key: rows[i : i + 1] for key, rows in reply.items()} for i in range(len(reply[ROW_KEYS[0]]))]


def append_next_rows(engine, chunks: dict[str, list], done: dict) -> int:
    """Each request's next chunk (its last one final); how many went to unfinished requests."""
    sent = 0
    for rid, rest in chunks.items():
        if rest:
            chunk = rest.pop(0)
            engine.append_inputs(rid, chunk, final=not rest)
            sent += rid not in done
    return sent
