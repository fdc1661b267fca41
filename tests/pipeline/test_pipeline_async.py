"""AsyncOmni: streaming final outputs, aborts that reach every stage and free KV blocks (the toy
pipeline's stages as threads; tests/pipeline/test_pipeline_e2e.py runs them as processes)."""
from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from tests.conftest import in_threads
from tests.pipeline.conftest import assert_matches, random_prompts, run_reference
from vllm_omni import AsyncOmni, SamplingParams


@pytest.fixture(scope="module")
def async_omni(toy_pipeline):
    omni = AsyncOmni(model=str(toy_pipeline.thinker), stage_configs_path=str(toy_pipeline.long_yaml),
                     stage_overrides=in_threads(3))
    yield omni
    omni.close()


async def collect(omni, prompt, params=None, request_id=None):
    return [out async for out in omni.generate(prompt, params, request_id=request_id)]


async def wait_for_stats(omni, stage_id, predicate, timeout_s=10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await omni.get_stage_stats(stage_id)
        if predicate(stats) or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.01)


def test_async_generate_matches_reference(async_omni):
    prompts = random_prompts(4, seed=7)

    async def run():
        return await asyncio.gather(*(collect(async_omni, {"prompt_token_ids": p}) for p in prompts))

    results = asyncio.run(run())
    for outs, ref in zip(results, run_reference(async_omni.pipeline, prompts), strict=True):
        assert [o.stage_id for o in outs] == [0, 2]  # yielded as each final stage finishes
        assert_matches(outs, ref)


def test_abort_lets_others_finish_and_frees_blocks(async_omni):
    long = [SamplingParams(temperature=0.0, max_tokens=1900, ignore_eos=True), None, None]

    async def run():
        total = (await async_omni.get_stage_stats(0)).kv_total_blocks
        aborted = asyncio.create_task(collect(async_omni, {"prompt_token_ids": [11, 12, 13]}, long, "victim"))
        # A second long request whose consumer goes away (a client disconnect).
        dropped = asyncio.create_task(collect(async_omni, {"prompt_token_ids": [21, 22]}, long, "dropped"))
        others = [asyncio.create_task(collect(async_omni, {"prompt_token_ids": p})) for p in random_prompts(3, 8)]
        busy = await wait_for_stats(async_omni, 0, lambda s: s.num_unfinished == 2)
        assert busy.num_unfinished == 2 and busy.kv_free_blocks < total  # both long ones hold blocks
        # where they are: in the running batch (a stalled run's report names these counts)
        assert busy.counts == {"running": 2, "waiting": 0, "waiting_for_input": 0, "resumable": 0}
        await async_omni.abort("victim")
        dropped.cancel()
        assert await aborted == []  # an aborted request ends without outputs
        with pytest.raises(asyncio.CancelledError):
            await dropped
        finished = await asyncio.gather(*others)
        stats = [await wait_for_stats(async_omni, s, lambda s: s.num_unfinished == 0) for s in (0, 1, 2)]
        return total, finished, stats

    total, finished, stats = asyncio.run(run())
    assert all([o.stage_id for o in outs] == [0, 2] for outs in finished)
    assert all(s.num_unfinished == 0 for s in stats)
    assert stats[0].kv_free_blocks == stats[0].kv_total_blocks == total
    assert stats[1].kv_free_blocks == stats[1].kv_total_blocks


def test_duplicate_request_id_is_rejected(async_omni):
    from vllm_omni.entrypoints.async_omni import RequestFailedError

    long = [SamplingParams(temperature=0.0, max_tokens=1900, ignore_eos=True), None, None]

    async def run():
        first = asyncio.create_task(collect(async_omni, {"prompt_token_ids": [5, 6]}, long, "same"))
        await wait_for_stats(async_omni, 0, lambda s: s.num_unfinished == 1)
        with pytest.raises(RequestFailedError, match="already in flight"):
            await collect(async_omni, {"prompt_token_ids": [5, 6]}, None, "same")
        await async_omni.abort("same")
        assert await first == []

    asyncio.run(run())


def test_output_kinds_give_one_result(async_omni):
    """FINAL_ONLY, CUMULATIVE and DELTA outputs of one request (the orchestrator's one
    OutputAccumulator makes all three): DELTA pieces add up to the FINAL_ONLY output, CUMULATIVE
    snapshots grow to it and stay as they were handed out."""
    from vllm_omni.outputs import RequestOutputKind

    prompt = {"prompt_token_ids": random_prompts(1, seed=21)[0]}

    async def run(kind):
        return [out async for out in async_omni.generate(prompt, request_id=f"kind-{kind.name}", output_kind=kind)]

    final, cumulative, delta = (asyncio.run(run(kind)) for kind in (
        RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA))
    whole = {o.stage_id: o.request_output.outputs[0] for o in final}
    assert sorted(whole) == [0, 2] and all(o.delta is o.request_output.outputs[0] for o in final)
    for stage_id, want in whole.items():
        pieces = [o for o in delta if o.stage_id == stage_id]
        snapshots = [o for o in cumulative if o.stage_id == stage_id]
        assert len(snapshots) == len(pieces) > (1 if stage_id == 0 else 0)  # text: an output per step
        assert all(o.request_output.outputs[0] is o.delta for o in pieces)
        assert [t for o in pieces for t in o.delta.token_ids] == want.token_ids
        assert "".join(o.delta.text for o in pieces) == want.text
        # Each snapshot holds what existed when it was handed out, nothing added later.
        lengths = [len(o.request_output.outputs[0].token_ids) for o in snapshots]
        assert lengths == list(itertools.accumulate(len(o.delta.token_ids) for o in snapshots))
        assert snapshots[-1].request_output.outputs[0].token_ids == want.token_ids
        assert [t for o in snapshots for t in o.delta.token_ids] == want.token_ids
        for key, tensor in want.multimodal_output.items():
            if tensor.dim():
                torch.testing.assert_close(torch.cat([o.delta.multimodal_output[key] for o in pieces
                                                      if key in o.delta.multimodal_output]), tensor)
                torch.testing.assert_close(snapshots[-1].request_output.outputs[0].multimodal_output[key], tensor)
