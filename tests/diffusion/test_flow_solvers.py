"""The diffusion engine's per-request solvers against diffusers' schedulers stepping the same
velocities: UniPC (Wan's, second order) and flow-match Euler (Qwen-Image's) give the same
samples to the bit."""
from __future__ import annotations

import pytest
import torch

from vllm_omni.model_executor.models.diffusion_solvers import FlowEuler, FlowUniPC, solver_for

FLOW = dict(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000)


def _run_both(make_scheduler, steps: int, set_begin_index: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    reference, ours = make_scheduler(), make_scheduler()
    reference.set_timesteps(steps)
    ours.set_timesteps(steps)
    if set_begin_index:
        reference.set_begin_index(0)
    solver = solver_for(ours)
    g = torch.Generator().manual_seed(0)
    x_ref = torch.randn(2, 4, 3, 5, 6, generator=g)
    x = x_ref.clone()
    ref_out, our_out = [], []
    for t in reference.timesteps:
        velocity = torch.randn(x.shape, generator=g)
        x_ref = reference.step(velocity, t, x_ref, return_dict=False)[0]
        x = solver.step(velocity, x)
        ref_out.append(x_ref)
        our_out.append(x)
    return ref_out, our_out


@pytest.mark.parametrize("order,steps,kwargs", [
    (2, 6, {}),  # Wan2.2's scheduler config
    (2, 1, {}),
    (3, 7, {}),  # a third-order predictor and corrector: linear systems solved when the solver is built
    (2, 5, {"disable_corrector": [0, 2]}),
    (2, 5, {"lower_order_final": False, "final_sigmas_type": "sigma_min"}),
    (1, 4, {"solver_type": "bh1", "final_sigmas_type": "sigma_min"}),
])
def test_unipc_equals_diffusers(order, steps, kwargs):
    from diffusers import UniPCMultistepScheduler

    def make():
        return UniPCMultistepScheduler(**FLOW, flow_shift=3.0, solver_order=order, **kwargs)

    reference, ours = _run_both(make, steps, set_begin_index=True)
    assert isinstance(solver_for(make()), FlowUniPC)
    for i, (r, o) in enumerate(zip(reference, ours)):
        # Third order sums two correction terms, which diffusers' einsum adds in its own order.
        assert torch.equal(r, o) if order < 3 else torch.allclose(r, o, rtol=0, atol=1e-5), f"step {i}"
    assert len(ours) == steps


def test_euler_equals_diffusers():
    from diffusers import FlowMatchEulerDiscreteScheduler

    reference, ours = _run_both(lambda: FlowMatchEulerDiscreteScheduler(shift=3.0), 4, set_begin_index=False)
    assert all(torch.equal(r, o) for r, o in zip(reference, ours))


def test_each_solver_keeps_its_own_state():
    """Two requests' solvers interleaved give what each gives alone (a batch of requests at
    different steps shares no scheduler state)."""
    from diffusers import UniPCMultistepScheduler

    def solver(steps):
        s = UniPCMultistepScheduler(**FLOW, flow_shift=5.0)
        s.set_timesteps(steps)
        return solver_for(s)

    g = torch.Generator().manual_seed(1)
    velocities = [torch.randn(3, 4, generator=g) for _ in range(5)]
    alone = torch.ones(3, 4)
    reference = solver(5)
    for v in velocities:
        alone = reference.step(v, alone)
    a, b, x, y = solver(5), solver(3), torch.ones(3, 4), torch.zeros(3, 4)
    for i, v in enumerate(velocities):
        x = a.step(v, x)
        if i < 3:
            y = b.step(-v, y)
    assert torch.equal(x, alone)


def test_unsupported_schedulers_are_named():
    from diffusers import DDIMScheduler, UniPCMultistepScheduler

    with pytest.raises(ValueError, match="DDIMScheduler is not supported"):
        solver_for(DDIMScheduler())
    eps = UniPCMultistepScheduler(prediction_type="epsilon")
    eps.set_timesteps(3)
    with pytest.raises(ValueError, match="use_flow_sigmas=False is not supported"):
        solver_for(eps)
    assert isinstance(FlowEuler(torch.tensor([1.0, 0.0])).step(torch.ones(2), torch.zeros(2)), torch.Tensor)
