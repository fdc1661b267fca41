"""AsyncOmni on Qwen2.5-Omni without audio: `output_modalities=["text"]` loads the bundled
thinker-only variant (one stage, run as a thread); `output_partial=True` streams the text."""
from __future__ import annotations

import asyncio

import pytest
import torch

from tests.conftest import in_threads
from tests.e2e.conftest import mixed_prompts, user
from vllm_omni import AsyncOmni


@pytest.fixture(scope="module")
def text_omni(omni_dir):
    omni = AsyncOmni(model=str(omni_dir), output_modalities=["text"], stage_overrides=in_threads(1))
    yield omni
    omni.close()


async def collect(omni, prompt, params=None, **kw):
    return [out async for out in omni.generate(prompt, params, **kw)]


def test_text_only_variant_streams_text_like_transformers(text_omni, omni_dir):
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    assert [s.model_stage for s in text_omni.pipeline.stages] == ["thinker"]
    assert text_omni.output_modalities == ["text"]
    messages = user({"type": "text", "text": "Name three colours."})
    params = [{"max_tokens": 16}]  # the bundled thinker defaults: greedy, repetition_penalty 1.1
    outs = asyncio.run(collect(text_omni, {"messages": messages}, params, request_id="s1", output_partial=True))

    *partial, final = outs
    assert final.finished and len(partial) >= 8 and not any(o.finished for o in partial)
    assert {o.request_id for o in outs} == {"s1"} and {o.final_output_type for o in outs} == {"text"}
    comp = final.request_output.outputs[0]
    # Each output: the cumulative text so far, plus the new part in `delta`.
    assert "".join(o.delta.text for o in outs) == comp.text
    assert [t for o in outs for t in o.delta.token_ids] == comp.token_ids
    for o in partial:
        assert comp.text.startswith(o.request_output.outputs[0].text)
        assert comp.token_ids[:len(o.request_output.outputs[0].token_ids)] == o.request_output.outputs[0].token_ids

    tok = AutoTokenizer.from_pretrained(omni_dir)
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              return_tensors="pt")["input_ids"]
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_mode="text",
                             thinker_max_new_tokens=16, thinker_do_sample=False, thinker_repetition_penalty=1.1)
    ref = ref.sequences if hasattr(ref, "sequences") else ref
    assert comp.token_ids == ref[0, ids.shape[1]:].tolist()


def test_multimodal_prompts_and_concurrency(text_omni):
    prompts = mixed_prompts()
    params = [{"max_tokens": 6}]

    async def run():
        together = await asyncio.gather(*(collect(text_omni, p, params) for p in prompts))
        solo = [await collect(text_omni, p, params) for p in prompts]
        return together, solo

    together, solo = asyncio.run(run())
    for i, (a, b) in enumerate(zip(together, solo)):
        assert [o.final_output_type for o in a] == ["text"] and a[0].error is None, i
        assert a[0].request_output.outputs[0].token_ids == b[0].request_output.outputs[0].token_ids, i


def test_unavailable_modality_and_bad_prompt(text_omni):
    with pytest.raises(ValueError, match=r"'audio' is not available; this pipeline produces \['text'\]"):
        asyncio.run(collect(text_omni, "Hi", modalities=["audio"]))
    with pytest.raises(ValueError, match="image"):
        asyncio.run(collect(text_omni, {"messages": user({"type": "image_url", "image_url": {"url": "data:,x"}})}))
    # Nothing was left running.
    assert asyncio.run(text_omni.get_stage_stats(0)).num_unfinished == 0
