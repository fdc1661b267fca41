import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from vllm_omni.model_executor.layers.sampler import Sampler, SamplingBatch, _penalty_inputs
from vllm_omni.sampling_params import SamplingParams

V = 50

# Every test runs on CPU; on a machine with CUDA the device-sensitive ones run there too
# (pinned async copies, CUDA generators, atomics in index_put_).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
on_devices = pytest.mark.parametrize("device", DEVICES)


def make_batch(params, prompts=None, outputs=None, generators=None):
    n = len(params)
    return SamplingBatch(
        params=params,
        prompt_token_ids=prompts or [[1, 2, 3]] * n,
        output_token_ids=outputs or [[] for _ in range(n)],
        generators=generators or [None] * n,
    )


def rand_logits(b, v=V, seed=0, device="cpu"):
    return (torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3).to(device)


def seeded_gen(seed, device="cpu"):
    return torch.Generator(device=device).manual_seed(seed)


@on_devices
def test_greedy_is_argmax(device):
    logits = rand_logits(4, device=device)
    out = Sampler()(logits, make_batch([SamplingParams(temperature=0.0)] * 4))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


@on_devices
def test_does_not_modify_input_logits(device):
    logits = rand_logits(2, device=device)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0, min_tokens=3, _eos_token_ids=(0,)),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.5, min_p=0.1),
    ]
    Sampler()(logits, make_batch(params, outputs=[[4, 4], [5]]))
    assert torch.equal(logits, before)


@on_devices
def test_repetition_penalty_matches_transformers(device):
    logits = rand_logits(3, device=device)
    prompts = [[1, 2, 3, 3], [7, 8], [10]]
    outputs = [[3, 4, 49], [], [10, 11, 11, 12]]
    penalties = [1.3, 1.7, 0.8]
    params = [SamplingParams(temperature=0.0, repetition_penalty=p) for p in penalties]
    got, _ = Sampler()._apply_penalties(logits, make_batch(params, prompts, outputs))
    for i in range(3):
        ids = torch.tensor([prompts[i] + outputs[i]], device=device)
        want = RepetitionPenaltyLogitsProcessor(penalties[i])(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(got[i : i + 1], want, rtol=0, atol=1e-6)
    out = Sampler()(logits, make_batch(params, prompts, outputs))
    assert out.token_ids == got.argmax(-1).tolist()


@on_devices
def test_presence_and_frequency_penalties_by_hand(device):
    logits = rand_logits(2, device=device)
    prompts = [[5, 6], [5]]  # prompt tokens are not counted for these penalties
    outputs = [[1, 1, 1, 2], [3]]
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(temperature=0.0, presence_penalty=-1.0),
    ]
    got, _ = Sampler()._apply_penalties(logits, make_batch(params, prompts, outputs))
    want = logits.clone()
    want[0, 1] -= 0.5 * 3 + 0.25
    want[0, 2] -= 0.5 * 1 + 0.25
    want[1, 3] -= -1.0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_penalties_only_for_rows_that_ask():
    logits = rand_logits(2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    got, _ = Sampler()._apply_penalties(logits, make_batch(params, [[1, 2], [1, 2]], [[3], [3]]))
    assert torch.equal(got[0], logits[0])
    assert not torch.equal(got[1], logits[1])


@on_devices
def test_min_tokens_masks_eos_and_stop_ids(device):
    logits = torch.zeros(1, V, device=device)
    logits[0, 7] = 10.0  # eos is the best token
    logits[0, 8] = 9.0  # then the stop token id
    logits[0, 9] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[8], _eos_token_ids=(7,))
    sampler = Sampler()
    assert sampler(logits, make_batch([params], outputs=[[1]])).token_ids == [9]
    assert sampler(logits, make_batch([params], outputs=[[1, 2]])).token_ids == [7]
    # ignore_eos does not mask anything in the sampler.
    ignore = SamplingParams(temperature=0.0, ignore_eos=True, _eos_token_ids=(7,))
    assert sampler(logits, make_batch([ignore], outputs=[[1]])).token_ids == [7]


def without_gpu_waits(mask_fn, logits, batch) -> torch.Tensor:
    """mask_fn(logits, batch) once to warm up (the pinned staging memory), then again where any
    wait for the GPU is an error."""
    mask_fn(logits, batch)
    torch.cuda.set_sync_debug_mode("error")
    try:
        return mask_fn(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_min_tokens_mask_does_not_wait_for_the_gpu():
    # A TTS step of 64 rows spent ~2 ms here when the mask's value came from host memory: the
    # copy waited for the step's forward, and the sampler's launches no longer overlapped it.
    params = SamplingParams(temperature=0.9, min_tokens=5, stop_token_ids=[8], _eos_token_ids=(7,))
    batch = make_batch([params] * 4, outputs=[[1]] * 4)
    logits = rand_logits(4, device="cuda")
    masked = without_gpu_waits(Sampler._apply_min_tokens, logits, batch)
    assert torch.isneginf(masked[:, [7, 8]]).all() and not torch.isneginf(logits).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_allowed_token_ids_mask_does_not_wait_for_the_gpu():
    params = [SamplingParams(temperature=0.9, allowed_token_ids=[3, 17, 42, 10**6]), SamplingParams(temperature=0.9),
              SamplingParams(temperature=0.9, allowed_token_ids=[5])]
    batch = make_batch(params)
    logits = rand_logits(3, device="cuda")
    finite = torch.isfinite(without_gpu_waits(Sampler._apply_allowed_tokens, logits, batch)).cpu()
    assert finite[0].nonzero().flatten().tolist() == [3, 17, 42] and finite[1].all()
    assert finite[2].nonzero().flatten().tolist() == [5]


@on_devices
def test_top_k_1_equals_greedy(device):
    logits = rand_logits(6, device=device)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 6
    for _ in range(5):
        assert Sampler()(logits, make_batch(params)).token_ids == logits.argmax(-1).tolist()


@on_devices
def test_tiny_top_p_gives_top_token(device):
    logits = rand_logits(6, device=device)
    params = [SamplingParams(temperature=1.0, top_p=1e-6)] * 6
    for _ in range(5):
        assert Sampler()(logits, make_batch(params)).token_ids == logits.argmax(-1).tolist()


def _histogram(logits_row, params, n=20000, seed=0, device="cpu"):
    torch.manual_seed(seed)
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous().to(device)
    out = Sampler()(logits, make_batch([params] * n))
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.numel()).double()


@on_devices
def test_min_p_drops_unlikely_tokens(device):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    counts = _histogram(probs.log(), SamplingParams(temperature=1.0, min_p=0.2), n=4000, device=device)
    assert counts[3] == 0  # 0.05 < 0.2 * 0.5
    assert (counts[:3] > 0).all()


@on_devices
def test_top_k_and_top_p_support(device):
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    counts = _histogram(probs.log(), SamplingParams(temperature=1.0, top_k=2), n=4000, device=device)
    assert counts[2:].sum() == 0 and (counts[:2] > 0).all()
    # Smallest set with cumulative probability >= 0.75 is {0, 1, 2}.
    counts = _histogram(probs.log(), SamplingParams(temperature=1.0, top_p=0.75), n=4000, device=device)
    assert counts[3] == 0 and (counts[:3] > 0).all()
    # Both: top-k first, then the nucleus of what is left (0.4 / 0.9 < 0.6 <= 0.7 / 0.9).
    counts = _histogram(probs.log(), SamplingParams(temperature=1.0, top_k=3, top_p=0.6), n=4000, device=device)
    assert counts[2:].sum() == 0 and (counts[:2] > 0).all()


@on_devices
def test_top_k_rows_mixed_with_unrestricted_rows(device):
    logits = rand_logits(4, device=device)
    params = [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    torch.manual_seed(0)
    seen = [set() for _ in params]
    for _ in range(200):
        for s, t in zip(seen, Sampler()(logits, make_batch(params)).token_ids):
            s.add(t)
    top3 = logits[2].topk(3).indices.tolist()
    assert seen[0] == {int(logits[0].argmax())} and seen[3] == {int(logits[3].argmax())}
    assert seen[2] <= set(top3) and len(seen[2]) >= 2
    assert len(seen[1]) > 3  # unrestricted


@on_devices
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_temperature_sampling_matches_distribution(temperature, device):
    probs = torch.tensor([0.35, 0.25, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01], dtype=torch.float64)
    n = 20000
    counts = _histogram(probs.log().float(), SamplingParams(temperature=temperature), n=n, device=device)
    expected = probs ** (1 / temperature)
    expected = expected / expected.sum() * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    # 7 degrees of freedom: mean 7; 40 is far in the tail (p ~ 1e-6). Seeded, so it cannot flake.
    assert chi2 < 40, (chi2, counts.tolist(), expected.tolist())


@on_devices
def test_mixed_greedy_and_random_rows(device):
    logits = rand_logits(4, device=device)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=1e-6),
    ]
    assert Sampler()(logits, make_batch(params)).token_ids == logits.argmax(-1).tolist()


def _run_steps(position, batch_size, steps=20, device="cpu"):
    """Sample `steps` tokens for a request with seed 1234 placed at `position` in a batch of
    `batch_size` with other seeded and unseeded rows; return its tokens."""
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    others = [
        SamplingParams(temperature=0.9, seed=7),
        SamplingParams(temperature=1.2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=5, seed=99),
    ]
    rows = []
    for j in range(batch_size):
        if j == position:
            rows.append(("target", target, seeded_gen(1234, device)))
        else:
            p = others[len(rows) % len(others)]
            rows.append(("other", p, seeded_gen(p.seed, device) if p.seed is not None else None))
    outputs = [[] for _ in rows]
    sampler = Sampler()
    torch.manual_seed(position * 31 + batch_size)  # the global RNG differs between runs
    for step in range(steps):
        # The target's logits are the same in every run; other rows get their own.
        logits = torch.stack(
            [
                rand_logits(1, seed=1000 + step)[0] if kind == "target" else rand_logits(1, seed=j * 100 + step)[0]
                for j, (kind, _, _) in enumerate(rows)
            ]
        ).to(device)
        batch = make_batch([p for _, p, _ in rows], outputs=[list(o) for o in outputs], generators=[g for *_, g in rows])
        for o, t in zip(outputs, sampler(logits, batch).token_ids):
            o.append(t)
    return outputs[position]


@on_devices
def test_seeded_rows_independent_of_batch(device):
    alone = _run_steps(0, 1, device=device)
    assert len(set(alone)) > 3  # it really samples
    assert _run_steps(0, 1, device=device) == alone
    for position in (0, 2, 4):
        assert _run_steps(position, 5, device=device) == alone


@on_devices
def test_logprobs_are_raw_log_softmax(device):
    logits = rand_logits(4, device=device)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=5.0),  # penalty changes the argmax
        SamplingParams(temperature=1.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, logprobs=5, top_k=3),
    ]
    prompts = [[int(logits[0].argmax())], [1], [1], [1]]
    out = Sampler()(logits, make_batch(params, prompts=prompts))
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids[0] != int(logits[0].argmax())
    assert out.logprobs[2] is None
    for i, n in ((0, 3), (1, 0), (3, 5)):
        lp = out.logprobs[i]
        sampled = out.token_ids[i]
        top = raw[i].topk(n).indices.tolist() if n else []
        assert set(lp) == {sampled, *top}
        for tok, value in lp.items():
            assert isinstance(tok, int)
            assert math.isclose(value, raw[i, tok].item(), abs_tol=1e-6)


def test_logprobs_only_some_rows():
    logits = rand_logits(3)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0)]
    out = Sampler()(logits, make_batch(params))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs[0] is None and out.logprobs[2] is None
    raw = torch.log_softmax(logits[1], dim=-1)
    assert set(out.logprobs[1]) == set(raw.topk(2).indices.tolist())


def test_allowed_token_ids_restrict_greedy_and_random_rows():
    logits = torch.randn(3, 50)
    allowed = [3, 17, 42]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed),
              SamplingParams(temperature=1.0, seed=5, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0)]
    batch = SamplingBatch(params=params, prompt_token_ids=[[1]] * 3, output_token_ids=[[]] * 3,
                          generators=[None, torch.Generator().manual_seed(5), None])
    out = Sampler()(logits, batch)
    assert out.token_ids[0] == allowed[int(logits[0, allowed].argmax())]
    assert out.token_ids[1] in allowed
    assert out.token_ids[2] == int(logits[2].argmax())


def test_allowed_token_ids_validation():
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


class _Owner:
    """Stands for an engine request: the penalty state keys its device rows by identity."""


@on_devices
def test_penalty_state_across_steps_equals_rebuilding_from_the_lists(device):
    """Rows kept on the device across steps (owners given) give the same penalized logits as
    the lists rebuilt every step, while requests come and go (rows are lent to new requests),
    a request's outputs change behind its back (recompute: the row is rebuilt), and the batch
    outgrows the rows (they grow)."""
    gen = torch.Generator().manual_seed(0)
    kept = Sampler()
    requests: dict[int, tuple[_Owner, list[int], list[int], SamplingParams]] = {}
    next_id = 0
    for step in range(40):
        if step in (0, 12, 25):  # arrivals: 3, then 9 more (outgrows the 8 rows), then 2
            for _ in range({0: 3, 12: 9, 25: 2}[step]):
                prompt = torch.randint(0, V + 5, (int(torch.randint(1, 9, (1,), generator=gen)),),
                                       generator=gen).tolist()  # ids >= V are dropped
                params = SamplingParams(temperature=0.0, repetition_penalty=[1.0, 1.3, 0.7][next_id % 3],
                                        frequency_penalty=0.2 * (next_id % 2), presence_penalty=0.1)
                requests[next_id] = (_Owner(), prompt, [], params)
                next_id += 1
        if step in (8, 20, 30):  # departures
            for rid in list(requests)[: 2]:
                del requests[rid]
        if step == 15:  # a recompute replaced one request's outputs
            owner, prompt, out, params = requests[next(iter(requests))]
            out[:] = out[: len(out) // 2]
        ids = sorted(requests, key=lambda _: float(torch.rand(1, generator=gen)))  # any order
        batch = make_batch([requests[i][3] for i in ids], [requests[i][1] for i in ids],
                           [requests[i][2] for i in ids])
        logits = rand_logits(len(ids), seed=step, device=device)
        want, _ = Sampler()._apply_penalties(logits, batch)
        batch.owners = [requests[i][0] for i in ids]
        state = kept.penalty_state
        rows, counts, prompt_seen = state.gather(batch.owners, batch.prompt_token_ids, batch.output_token_ids,
                                                 V, logits.device)
        want_counts, want_seen = _penalty_inputs(batch, V, logits.device)
        assert torch.equal(counts, want_counts) and torch.equal(prompt_seen, want_seen)
        got = kept(logits, batch)  # gathers the same rows again: only sampling counts a token
        assert got.token_ids == want.argmax(-1).tolist()
        for i, token in zip(ids, got.token_ids):
            requests[i][2].append(token)  # as the engine appends the sampled token
    assert state.counts.shape[0] == 16  # grew once, from 8, when 10 requests were live
    assert state.builds == next_id + 1  # each request once, plus the one whose outputs were replaced


def test_penalty_state_past_its_memory_cap_falls_back_to_the_lists(monkeypatch):
    from vllm_omni.model_executor.layers import penalty_state

    monkeypatch.setattr(penalty_state, "MAX_BYTES", 8 * V * 5 - 1)  # fewer than 8 rows fit
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5)] * 2
    batch = make_batch(params, [[1, 2], [3]], [[4, 4], [5]])
    logits = rand_logits(2)
    want, _ = Sampler()._apply_penalties(logits, batch)
    batch.owners = [_Owner(), _Owner()]
    sampler = Sampler()
    got, rows = sampler._apply_penalties(logits, batch)
    assert rows is None and sampler.penalty_state.counts is None  # nothing allocated on the device
    assert torch.equal(got, want)
