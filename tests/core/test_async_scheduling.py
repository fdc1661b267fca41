"""Async scheduling (LLMEngine.step): the next step is launched before the host reads the tokens
of the step in flight. Whatever the requests do (stop rules, penalties, logprobs, preemption,
abort, streamed outputs), every request gets the outputs the synchronous engine gives it."""
from __future__ import annotations

import pytest
import torch

from vllm_omni.core.engine_config import EngineConfig
from vllm_omni.core.llm_engine import LLMEngine
from vllm_omni.output_accumulator import OutputAccumulator
from vllm_omni.sampling_params import PLACEHOLDER_TOKEN, SamplingParams


def make_engine(model_dir, async_scheduling: bool, device: str = "cpu", **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device=device, async_scheduling=async_scheduling,
                                  enable_prefix_caching=True, **kw))


def request_mix(stop_token: int, stop_string: str) -> list[SamplingParams]:
    """Every sampling feature whose host work the async step moves: random rows are seeded (their
    draws then do not depend on batch mates, whose rows differ when a stopped request's next step
    was already launched)."""
    rand = dict(temperature=0.8, top_k=20, top_p=0.9)
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(**rand, seed=1, max_tokens=15, repetition_penalty=1.3, frequency_penalty=0.2,
                       presence_penalty=0.1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(**rand, seed=2, max_tokens=10, min_tokens=6, logprobs=3, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(**rand, seed=3, max_tokens=9, stop_token_ids=[stop_token], ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=14, stop=[stop_string], ignore_eos=True),
    ]


def run(engine: LLMEngine, params: list[SamplingParams], prompts: list[list[int]], stream: bool
        ) -> tuple[dict, dict, dict]:
    """Final outputs by request id, streamed token ids by request id, and what the run saw:
    steps, steps that left tokens on the device, preemptions."""
    accumulators = {}  # the outputs are deltas: each request's whole output so far
    for i, (p, ids) in enumerate(zip(params, prompts)):
        engine.add_request(str(i), ids, p, stream=stream)
        accumulators[str(i)] = OutputAccumulator(str(i), None, ids)
    finals, streamed = {}, {str(i): [] for i in range(len(params))}
    seen = {"steps": 0, "deferred": 0, "preempted": 0}
    schedule = engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        seen["preempted"] += len(out.preempted)
        return out

    engine.scheduler.schedule = counting_schedule
    while engine.has_unfinished_requests():
        outputs = engine.step()
        seen["steps"] += 1
        seen["deferred"] += engine._pending is not None
        for out in outputs:
            whole = accumulators[out.request_id]
            whole.add(out)
            streamed[out.request_id] = list(whole.output.outputs[0].token_ids)
            if out.finished:
                finals[out.request_id] = whole.output.outputs[0]
    return finals, streamed, seen


def prompts_for(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def probe_stops(model, prompts: list[list[int]], device: str, **kw) -> tuple[int, str]:
    """A token that request 2 generates greedily and a string in request 6's greedy text: both
    stop their requests partway."""
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    outs = run(make_engine(model, False, device=device, **kw), [greedy, greedy], [prompts[2], prompts[6]], False)[0]
    text = outs["1"].text
    assert text.strip(), "the probe generated no text"
    return outs["0"].token_ids[5], text[len(text) // 2:][:3]


def assert_same(sync: dict, fast: dict) -> None:
    assert sorted(sync) == sorted(fast)
    for rid in sync:
        a, b = sync[rid], fast[rid]
        assert b.token_ids == a.token_ids, rid
        assert PLACEHOLDER_TOKEN not in b.token_ids
        assert (b.finish_reason, b.stop_reason, b.text) == (a.finish_reason, a.stop_reason, a.text), rid
        # A launched step of a request that had stopped makes a batch one row larger than the
        # synchronous engine's: the products' blocking, hence the last float bits, may differ.
        assert (b.logprobs is None) == (a.logprobs is None), rid
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x), rid


@pytest.mark.parametrize("stream", [False, True])
def test_async_steps_give_the_synchronous_outputs(tiny_model, stream):
    model = tiny_model("qwen3")
    # A pool of 14 blocks of 4 tokens for 7 requests of up to ~30 tokens: requests are preempted.
    kw = dict(block_size=4, num_kv_blocks=14, max_num_seqs=5)
    sync_engine = make_engine(model, False, **kw)
    prompts = prompts_for(7, sync_engine.vocab_size)
    params = request_mix(*probe_stops(model, prompts, device="cpu"))
    sync, sync_streamed, sync_seen = run(sync_engine, params, prompts, stream)
    fast, fast_streamed, fast_seen = run(make_engine(model, True, **kw), params, prompts, stream)
    assert_same(sync, fast)
    assert sync["2"].finish_reason == sync["6"].finish_reason == "stop" and len(sync["4"].token_ids) == 1
    assert sync_seen["deferred"] == 0 and fast_seen["deferred"] > 0.5 * fast_seen["steps"]
    assert sync_seen["preempted"] > 0 and fast_seen["preempted"] > 0
    if stream:
        assert fast_streamed == sync_streamed


def test_abort_with_a_token_in_flight(tiny_model):
    """An aborted request's output holds only the tokens the host read; its batch mates go on as if
    it had been aborted in a synchronous engine."""
    model = tiny_model("qwen3")
    engine = make_engine(model, True)
    prompts = prompts_for(3, engine.vocab_size)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * 3
    for i, (p, ids) in enumerate(zip(params, prompts)):
        engine.add_request(str(i), ids, p)
    for _ in range(4):
        engine.step()
    request = engine.scheduler.requests["1"]
    assert request.has_placeholder and request.token_ids[-1] == PLACEHOLDER_TOKEN
    aborted = engine.abort_request("1")[0]  # its one output (it does not stream): all it made
    assert aborted.finish_reason == "abort" and PLACEHOLDER_TOKEN not in aborted.new_token_ids
    assert len(aborted.new_token_ids) == 3  # 4 steps sampled 4 tokens: the last is still in flight
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out.new_token_ids
    sync = run(make_engine(model, False), [params[0], params[2]], [prompts[0], prompts[2]], stream=False)[0]
    assert finals == {"0": sync["0"].token_ids, "2": sync["1"].token_ids}


def test_prefix_cache_and_pauses_with_tokens_in_flight(tiny_model):
    """Blocks are hashed only once their tokens are read (a later prompt that extends an earlier
    request's output hits the same cached blocks), and a request paused with a token in flight
    resumes where it was."""
    model = tiny_model("qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)

    def scenario(async_scheduling: bool):
        engine = make_engine(model, async_scheduling, block_size=4)
        first_prompt, other_prompt = prompts_for(2, engine.vocab_size)
        engine.add_request("a", first_prompt, params)
        engine.add_request("b", other_prompt, params)
        finals, deferred = {}, 0
        for step in range(40):
            if step == 5:
                engine.pause_requests(["b"], True)
                deferred_at_pause = engine.scheduler.requests["b"].has_placeholder
            if step == 9:
                engine.pause_requests(["b"], False)
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
            deferred += engine._pending is not None
            if not engine.has_unfinished_requests():
                break
        # Asynchronous: b was paused with a token in flight.
        assert (deferred_at_pause and deferred > 0) if async_scheduling else deferred == 0
        assert sorted(finals) == ["a", "b"]
        extended = first_prompt + list(finals["a"].new_token_ids)
        engine.add_request("c", extended, params)
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
        outputs = {rid: (o.new_token_ids, o.num_cached_tokens) for rid, o in finals.items()}
        return outputs, len(extended)

    (fast, extended), (sync, _) = scenario(True), scenario(False)
    assert fast == sync
    # Request a computed every token of the extended prompt but its last output: all its full blocks hit.
    assert fast["c"][1] == 4 * ((extended - 1) // 4) > 0


@pytest.mark.parametrize("stream", [False, True])
def test_hidden_states_of_steps_in_flight(tiny_model, stream):
    """Requests that export hidden states (a thinker feeding a talker) step asynchronously too:
    their rows are read with their tokens, a step later, and every position's row comes out once,
    preempted and recomputed requests included."""
    model = tiny_model("qwen3")
    kw = dict(block_size=4, num_kv_blocks=12, max_num_seqs=4, hidden_state_layers=(1,))

    def scenario(async_scheduling: bool):
        engine = make_engine(model, async_scheduling, **kw)
        prompts = prompts_for(5, engine.vocab_size)
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), ids, SamplingParams(temperature=0.0, max_tokens=10 + i, ignore_eos=True),
                               return_hidden_states=i % 2 == 0, stream=stream)
        rows: dict[str, dict[str, list[torch.Tensor]]] = {}
        tokens, deferred, preempted = {}, 0, 0
        schedule = engine.scheduler.schedule

        def counting_schedule():
            nonlocal preempted
            out = schedule()
            preempted += len(out.preempted)
            return out

        engine.scheduler.schedule = counting_schedule
        while engine.has_unfinished_requests():
            for out in engine.step():
                for key, t in out.multimodal_output.items():
                    rows.setdefault(out.request_id, {}).setdefault(key, []).append(t)
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            deferred += engine._pending is not None
        joined = {rid: {key: torch.cat(parts) for key, parts in by_key.items()} for rid, by_key in rows.items()}
        return tokens, joined, prompts, deferred, preempted

    fast_tokens, fast_rows, prompts, deferred, preempted = scenario(True)
    sync_tokens, sync_rows, _, sync_deferred, _ = scenario(False)
    assert fast_tokens == sync_tokens
    assert sorted(fast_rows) == sorted(sync_rows) == ["0", "2", "4"]
    for rid in sync_rows:
        # Every prompt position and every output but the last (whose state no step computed).
        expected = len(prompts[int(rid)]) + len(sync_tokens[rid]) - 1
        assert sorted(fast_rows[rid]) == sorted(sync_rows[rid]) == ["1", "last"]
        for key, want in sync_rows[rid].items():
            assert want.shape[0] == expected
            # Batches differ by a dropped row at times (and so do recompute chunks): float noise
            # only; a row out of place would differ by the rows' own size.
            torch.testing.assert_close(fast_rows[rid][key], want, atol=1e-3, rtol=1e-3)
    assert deferred > 0 and sync_deferred == 0 and preempted > 0
