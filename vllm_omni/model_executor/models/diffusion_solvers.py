"""The sampler update of one diffusion request: diffusers' flow-matching schedulers as solvers.

A request's solver is built from the diffusers scheduler its pipeline names, after that
scheduler's `set_timesteps` (the model does that in `prepare`), and keeps the request's own
state, so requests at different steps share a batch. Every coefficient is computed on the CPU
when the solver is built, with the scheduler's own float32 arithmetic; a step is only
elementwise tensor work on the sample's device: no host synchronisation in the loop (diffusers'
UniPC moves its sigmas to the device and solves a small linear system there every step).

    FlowEuler     FlowMatchEulerDiscreteScheduler: x + (sigma_next - sigma) * v
    FlowUniPC     UniPCMultistepScheduler with flow sigmas (Wan's): predictor-corrector, order 1-3
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class FlowSolver(Protocol):
    def step(self, velocity: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """The sample after this request's next step, given the (guided) velocity prediction."""
        ...


def solver_for(scheduler: Any) -> FlowSolver:
    """The solver of a diffusers scheduler on which `set_timesteps` ran. ValueError: a scheduler
    (or a setting of one) this engine does not implement."""
    name = type(scheduler).__name__
    if name == "FlowMatchEulerDiscreteScheduler":
        if scheduler.config.get("stochastic_sampling", False):
            raise ValueError("FlowMatchEulerDiscreteScheduler with stochastic_sampling is not supported")
        return FlowEuler(scheduler.sigmas)
    if name == "UniPCMultistepScheduler":
        return FlowUniPC.from_scheduler(scheduler)
    raise ValueError(f"scheduler {name} is not supported by the diffusion engine (supported: "
                     "FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler with flow sigmas)")


class FlowEuler:
    """diffusers' FlowMatchEulerDiscreteScheduler.step: x + (sigma_next - sigma) * v in float32,
    cast back to the prediction's dtype."""

    def __init__(self, sigmas: torch.Tensor) -> None:
        self.sigmas = sigmas  # [steps + 1], on the sample's device (indexing it does not sync)
        self.index = 0

    def step(self, velocity: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        dt = self.sigmas[self.index + 1] - self.sigmas[self.index]
        self.index += 1
        return (sample.to(torch.float32) + dt * velocity).to(velocity.dtype)


@dataclass(frozen=True)
class _Update:
    """One UniP (predictor) or UniC (corrector) update in diffusers' B(h) form with x0 prediction:
    x_t = ratio * x - c0 * m0 - scale * (sum_k rhos[k] * (m_k - m0) / rks[k] [+ rhos[-1] * (model_t - m0)])."""

    order: int
    ratio: float  # sigma_t / sigma_s0
    c0: float  # alpha_t * h_phi_1
    scale: float  # alpha_t * B(h)
    rks: tuple[float, ...]  # one per earlier model output
    rhos: tuple[float, ...]


class FlowUniPC:
    """diffusers' UniPCMultistepScheduler (use_flow_sigmas, flow_prediction, predict_x0): a
    multistep predictor with a corrector, so each request keeps its last model outputs."""

    def __init__(self, sigmas: torch.Tensor, *, solver_order: int, solver_type: str, lower_order_final: bool,
                 disable_corrector: Sequence[int]) -> None:
        sigmas = sigmas.to("cpu", torch.float32)
        steps = len(sigmas) - 1
        self.sigmas = [float(s) for s in sigmas]
        self.solver_order = solver_order
        orders = [_order(i, steps, solver_order, lower_order_final) for i in range(steps)]
        self._predictors = [_update(sigmas, i, orders[i], solver_type, corrector=False) for i in range(steps)]
        # Step i corrects the sample step i - 1 predicted, at that step's order.
        self._correctors: list[_Update | None] = [None] + [
            None if i - 1 in disable_corrector else _update(sigmas, i, orders[i - 1], solver_type, corrector=True)
            for i in range(1, steps)]
        self.index = 0
        self._outputs: list[torch.Tensor] = []  # converted model outputs (x0), newest last
        self._last_sample: torch.Tensor | None = None

    @classmethod
    def from_scheduler(cls, scheduler: Any) -> FlowUniPC:
        config = scheduler.config
        unsupported = {"use_flow_sigmas": (True,), "prediction_type": ("flow_prediction",), "predict_x0": (True,),
                       "thresholding": (False,), "solver_p": (None,), "solver_type": ("bh1", "bh2")}
        for key, allowed in unsupported.items():
            if config.get(key) not in allowed:
                raise ValueError(f"UniPCMultistepScheduler with {key}={config.get(key)!r} is not supported "
                                 f"(supported: {' or '.join(repr(a) for a in allowed)})")
        return cls(scheduler.sigmas, solver_order=config.solver_order, solver_type=config.solver_type,
                   lower_order_final=config.lower_order_final, disable_corrector=tuple(config.disable_corrector))

    def step(self, velocity: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        i = self.index
        x0 = sample - self.sigmas[i] * velocity  # convert_model_output (flow prediction -> x0)
        corrector = self._correctors[i]
        if corrector is not None and self._last_sample is not None:
            sample = _apply(corrector, self._last_sample, self._outputs, x0)
        self._outputs = [*self._outputs, x0][-self.solver_order:]
        self._last_sample = sample
        self.index += 1
        return _apply(self._predictors[i], sample, self._outputs, None)


def _order(i: int, steps: int, solver_order: int, lower_order_final: bool) -> int:
    """The predictor's order at step i: diffusers' warm-up (lower_order_nums) and lower_order_final."""
    order = min(solver_order, steps - i) if lower_order_final else solver_order
    return min(order, min(i, solver_order) + 1)


def _update(sigmas: torch.Tensor, i: int, order: int, solver_type: str, *, corrector: bool) -> _Update:
    """The coefficients of UniPCMultistepScheduler.multistep_uni_p_bh_update (predictor, from step i
    to i + 1) or multistep_uni_c_bh_update (corrector of step i - 1's prediction), in the
    scheduler's own float32 operations."""
    t, s0 = (i, i - 1) if corrector else (i + 1, i)

    def lam(index: int) -> torch.Tensor:
        return torch.log(1 - sigmas[index]) - torch.log(sigmas[index])  # flow sigmas: alpha = 1 - sigma

    alpha_t = 1 - sigmas[t]
    h = lam(t) - lam(s0)
    rks = [(lam(s0 - k) - lam(s0)) / h for k in range(1, order)]
    hh = -h  # predict_x0
    h_phi_1 = torch.expm1(hh)
    b_h = hh if solver_type == "bh1" else torch.expm1(hh)
    rhos = _rhos(rks, hh, h_phi_1, b_h, order, corrector)
    return _Update(order, float(sigmas[t] / sigmas[s0]), float(alpha_t * h_phi_1), float(alpha_t * b_h),
                   tuple(float(r) for r in rks), tuple(float(r) for r in rhos))


def _rhos(rks: list[torch.Tensor], hh: torch.Tensor, h_phi_1: torch.Tensor, b_h: torch.Tensor, order: int,
          corrector: bool) -> torch.Tensor:
    if corrector and order == 1:
        return torch.tensor([0.5])
    if not corrector and order <= 2:
        return torch.tensor([0.5] * (order - 1))  # order 1: no term; order 2: diffusers' fixed 0.5
    r = torch.stack([*rks, torch.ones(())])
    rows, b = [], []
    h_phi_k, factorial = h_phi_1 / hh - 1, 1
    for k in range(1, order + 1):
        rows.append(torch.pow(r, k - 1))
        b.append(h_phi_k * factorial / b_h)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    matrix, b = torch.stack(rows), torch.stack(b)
    return torch.linalg.solve(matrix, b) if corrector else torch.linalg.solve(matrix[:-1, :-1], b[:-1])


def _apply(u: _Update, x: torch.Tensor, outputs: list[torch.Tensor], model_t: torch.Tensor | None) -> torch.Tensor:
    """x: the sample the update starts from; outputs: converted model outputs, newest last (m0);
    model_t: the corrector's new model output (None for the predictor)."""
    m0 = outputs[-1]
    result = u.ratio * x - u.c0 * m0
    terms = [u.rhos[k] * ((outputs[-(k + 2)] - m0) / u.rks[k]) for k in range(u.order - 1)]
    if model_t is not None:
        terms.append(u.rhos[-1] * (model_t - m0))
    if terms:
        total = terms[0]
        for term in terms[1:]:
            total = total + term
        result = result - u.scale * total
    return result.to(x.dtype)
